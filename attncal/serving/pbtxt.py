"""Triton `config.pbtxt` writing and checking.

Configs are built as plain dicts and written in protobuf text format by a small
emitter, so generating a repository needs no Triton package.  `validate` parses
the text strictly against Triton's own `ModelConfig` message (shipped as
`tritonclient.grpc.model_config_pb2`) when tritonclient is installed: an unknown
field, a wrong type or a misspelt enum is then an error, not a silent
server-side surprise.
"""

from __future__ import annotations

from typing import Any, Mapping


class Enum(str):
    """A protobuf enum value: written bare (`TYPE_FP32`), not quoted."""


def _scalar(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {type(value).__name__} in a model config")


def _fields(msg: Mapping[str, Any], indent: int) -> list[str]:
    pad = "  " * indent
    lines: list[str] = []
    for key, value in msg.items():
        if value is None:
            continue
        if isinstance(value, Mapping):
            lines.append(f"{pad}{key} {{")
            lines += _fields(value, indent + 1)
            lines.append(f"{pad}}}")
        elif isinstance(value, (list, tuple)):
            if value and all(isinstance(v, Mapping) for v in value):
                for item in value:  # repeated message: one block per item
                    lines.append(f"{pad}{key} {{")
                    lines += _fields(item, indent + 1)
                    lines.append(f"{pad}}}")
            elif value:
                lines.append(f"{pad}{key}: [ {', '.join(_scalar(v) for v in value)} ]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return lines


def dumps(config: Mapping[str, Any]) -> str:
    """`config` in protobuf text format. Maps (`parameters`, `input_map`) are given as
    lists of `{"key": ..., "value": ...}` dicts, as text format spells them."""
    return "\n".join(_fields(config, 0)) + "\n"


def model_config_message():
    """A fresh Triton `ModelConfig` message, or None when tritonclient is not installed."""
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return None
    return model_config_pb2.ModelConfig()


def validate(text: str, *, required: bool = False):
    """Parse `text` strictly as a Triton ModelConfig; returns the message, or None when
    tritonclient is missing and `required` is false.  Raises ValueError on a bad config."""
    from google.protobuf import text_format

    msg = model_config_message()
    if msg is None:
        if required:
            raise ValueError("validating a Triton config needs tritonclient: pip install 'tritonclient[grpc]'")
        return None
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as exc:
        raise ValueError(f"invalid Triton model config: {exc}") from None
    if not msg.name:
        raise ValueError("invalid Triton model config: no name")
    if not (msg.backend or msg.platform):
        raise ValueError(f"invalid Triton model config {msg.name!r}: neither backend nor platform")
    return msg
