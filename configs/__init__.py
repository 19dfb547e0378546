"""Experiment configs: one module per experiment, each with `get_config(variant)`.

A config module defines:
  DESCRIPTION: str         one line for `python -m jaxflow.run --list`
  ENTRY: str               "package.module:function" called as fn(config, run) -> summary dict
  HEADLINES: str           "package.module:function" called as fn(summary) -> [Headline, ...]
                           (jaxflow.study.headline): the summary's "headlines"
  VARIANTS: tuple[str,...] normally ("quick", "default", "full"), from get_config.variants
  get_config(variant) ->   usually jaxflow.config.Variants(quick=..., default=..., full=...)
  get_config(variant) ->   a frozen dataclass (nested frozen dataclasses allowed)
"""
