"""How gazctl's YAML files share settings between specs, for journals and shards alike.

Loading, a spec inherits its parent's settings (a journal directory, or a
shard file's ``common``) and its labels merge with the parent's by name.
Dumping runs the other way: the settings a group of specs shares are hoisted
into the parent. Both spec kinds flatten their settings into one mapping per
spec, so "shared" is a plain intersection and "own" a plain difference.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FlatSettings",
    "flatten_labels",
    "merge_labels",
    "settings_beyond",
    "shared_settings",
]

# A spec's settings as one flat mapping, e.g. ("fragment", "length") -> 1024,
# ("labels", "app") -> ("wordcount",), ("replication",) -> 1.
FlatSettings = dict[tuple[str, ...], Any]
_MISSING = object()


def flatten_labels(flat: FlatSettings, labels: list[dict[str, str]]) -> None:
    """Put dumped labels into `flat`, one slot per label name holding all its values."""
    for label in labels:
        slot = ("labels", label["name"])
        flat[slot] = (*flat.get(slot, ()), label["value"])


def merge_labels(parent: Any, child: Any) -> Any:
    """Child labels replace the parent's labels of the same name.

    Either side may be malformed (not a list): the child is then taken as is,
    for the model's validation to report.
    """
    if not isinstance(parent, list) or not isinstance(child, list):
        return child
    names = {item.get("name") for item in child if isinstance(item, dict)}
    kept = [item for item in parent if not (isinstance(item, dict) and item.get("name") in names)]
    return kept + child


def shared_settings(flats: list[FlatSettings]) -> FlatSettings:
    """The settings every one of ``flats`` has, with the same value (a parent can hoist them)."""
    first, *rest = flats
    return {k: v for k, v in first.items() if all(f.get(k, _MISSING) == v for f in rest)}


def settings_beyond(flat: FlatSettings, scope: FlatSettings) -> FlatSettings:
    """Settings of ``flat`` that ``scope`` does not already provide."""
    return {k: v for k, v in flat.items() if scope.get(k, _MISSING) != v}
