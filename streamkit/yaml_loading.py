"""Reading the YAML files a user writes (streamkit.yaml, journal and shard spec files).

`yaml.safe_load` lets a mapping key given twice silently replace the first
(`shards: 4` ... `shards: 2` runs with 2), hiding an edit mistake. The YAML
spec requires unique keys, so `load_yaml` refuses them, with a
`yaml.constructor.ConstructorError` like any other YAML error: callers report
it through `yaml_problem`, which names the line.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

__all__ = ["load_yaml"]

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a mapping key given twice.

    Keys that `<<` merges in may still be overridden: that is what merging is for.
    """

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first_seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = first_seen.setdefault(key, key_node)
                except TypeError:  # unhashable: the base class reports it
                    continue
                if first is not key_node:
                    raise ConstructorError(
                        None, None,
                        f"key {key!r} given twice (first on line {first.start_mark.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, except that a duplicate mapping key raises ConstructorError."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
