"""Checking a plugin's chat renderer against a Jinja chat template carried in a GGUF (tests and plugin authors).

The template is rendered with transformers' own Jinja setup (``render_jinja_template``), the environment a model's
``tokenizer.chat_template`` is written for; transformers and jinja2 are imported only when rendering.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from ds4_core.chat import ChatFormat


def convert_cli(src: Path, out: Path, outtype: str = "f16") -> None:
    """``ds4 convert SRC OUT --outtype OUTTYPE`` through the CLI, asserting it succeeds."""
    from click.testing import CliRunner

    from ds4_core.cli import cli

    result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--outtype", outtype])
    assert result.exit_code == 0, result.output


def gguf_template_bytes(path: Path) -> bytes | None:
    """The raw bytes of ``tokenizer.chat_template`` in the GGUF at ``path`` (read by gguf-py), or None."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("tokenizer.chat_template")
    return None if field is None else field.parts[field.data[0]].tobytes()


def render(template: str, messages: list[dict[str, Any]], *, tools: list | None, add_generation_prompt: bool = True,
           **variables: Any) -> str:
    """``template`` rendered on one conversation as Hugging Face tokenizers render it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **variables)
    return rendered[0]


def openai_form(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as an OpenAI client sends them: tool-call arguments as JSON text, calls with ids."""
    out = copy.deepcopy(messages)
    for message in out:
        for index, call in enumerate(message.get("tool_calls") or ()):
            call["id"] = f"call_{index}"
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


def template_in_tokenizer_config(src: Path, template: str) -> None:
    """Write ``template`` as ``chat_template`` into the Hugging Face directory's ``tokenizer_config.json``."""
    path = src / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    path.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


def info_template(path: Path) -> str | None:
    """The chat template ``ds4 info PATH --json`` reports, asserting the command succeeds."""
    from click.testing import CliRunner

    from ds4_core.cli import cli

    result = CliRunner().invoke(cli, ["info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["chat_template"]


def both_renderings(renderer: ChatFormat, template: str, messages: list[dict[str, Any]], *, tools: list | None,
                    thinking: str, template_variables: dict[str, Any],
                    add_generation_prompt: bool = True) -> tuple[str, str]:
    """(``renderer``'s prompt for ``messages`` sent in OpenAI form, ``template`` rendered on them with
    ``template_variables``, the template's way of saying ``thinking``)."""
    ours = renderer.render(openai_form(messages), tools=tools, thinking=thinking,
                           add_generation_prompt=add_generation_prompt)
    return ours, render(template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                        **template_variables)
