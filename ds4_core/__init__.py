"""ds4-core: a small inference core for large open-weight models, extended by plugins."""

from .errors import Ds4Error

__version__ = "0.1.0"

#: Incremented when the hook contract changes incompatibly; plugins declare the one they target.
PLUGIN_API_VERSION = 1

__all__ = ["PLUGIN_API_VERSION", "Ds4Error", "__version__"]
