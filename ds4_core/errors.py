"""The project's exception hierarchy.

Every error a user can cause derives from :class:`Ds4Error`; its message says
what is wrong and what to do. The CLI prints the message alone (``--debug``
shows the traceback).
"""


class Ds4Error(Exception):
    """Base of every error ds4-core raises on purpose."""


class GGUFError(Ds4Error):
    """A GGUF file cannot be read: bad container, bad metadata or bad tensor table."""


class GGUFFormatError(GGUFError):
    """The container itself is malformed (magic, version, lengths, offsets, truncation)."""


class GGUFMetadataError(GGUFError):
    """A metadata key is missing or has the wrong type or value."""


class GGUFTensorError(GGUFError):
    """A tensor is missing, duplicated, of an unknown type, or has the wrong shape or type."""


class ModelConfigError(Ds4Error):
    """The model's hyperparameters are missing, inconsistent or out of range."""


class TokenizerError(Ds4Error):
    """The tokenizer metadata is malformed or a token id is out of range."""


class PluginError(Ds4Error):
    """A plugin failed to load, declared a duplicate name, or targets another plugin API."""


class BackendError(Ds4Error):
    """No backend can run the model, or the chosen backend is unavailable."""


class ContextError(Ds4Error):
    """A prompt or a requested context does not fit the model or the memory."""


class DeviceMemoryError(Ds4Error):
    """The model's weights do not fit the memory the chosen backend has free."""


class ConversionError(Ds4Error):
    """A source checkpoint cannot be converted to GGUF."""


class TemplateError(Ds4Error):
    """A chat template or message list cannot be rendered."""
