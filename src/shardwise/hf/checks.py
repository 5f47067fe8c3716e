"""``model.init_from = "hf:PATH"`` in the config: the directory's config.json gives the model's shape, and its
weights' names and shapes are checked from the safetensors headers before any worker starts."""

from __future__ import annotations

from shardwise.config import ConfigError, ModelConfig

DEFAULT_MODEL = ModelConfig()


def apply_init_from(m: ModelConfig) -> None:
    """Fill the model's shape from the config.json of ``m.init_from``; a field given explicitly must agree."""
    from shardwise.hf.config_map import HFError, hf_path, model_fields, read_hf_config

    try:
        path = hf_path(m.init_from)
        fields = model_fields(read_hf_config(path), f"{path}/config.json")
    except HFError as e:
        raise ConfigError(f"model.init_from={m.init_from!r}: {e}") from None
    if m.preset not in ("cpu-demo", "custom"):
        raise ConfigError(f"model.preset={m.preset!r} with model.init_from={m.init_from!r}: the directory's "
                          "config.json gives the model's shape; remove model.preset")
    m.preset = "custom"
    for key, value in fields.items():
        given, default = getattr(m, key), getattr(DEFAULT_MODEL, key)
        if given is not None and given != default and given != value:
            raise ConfigError(f"model.{key}={given!r} but model.init_from={m.init_from!r} has {value!r}; "
                              f"remove model.{key}")
        setattr(m, key, value)


def check_init_from(m: ModelConfig) -> None:
    """The weights' names and shapes (headers only), once the model's fields are resolved."""
    if not m.init_from or m.vocab_size is None:
        return
    from shardwise.hf.config_map import HFError, hf_path
    from shardwise.hf.load import check_directory

    try:
        check_directory(hf_path(m.init_from), m)
    except HFError as e:
        raise ConfigError(f"model.init_from={m.init_from!r}: {e}") from None
