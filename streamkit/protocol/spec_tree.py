"""Journal specs in gazctl's hierarchical YAML form: ``load_specs`` and ``dump_specs``.

A node whose name ends in "/" is a directory: its ``children`` inherit its
settings (labels merge by name, fragment fields one by one), and their names
must start with its name. Other nodes are journals. Nodes may also carry
``revision`` (the expected mod revision for Apply; 0 creates, -1 skips the
check), ``delete: true`` and ``comment``. Dumping hoists the settings a
directory's journals share into the directory, so files stay short.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from streamkit.protocol.inheritance import (
    FlatSettings,
    flatten_labels,
    merge_labels,
    settings_beyond,
    shared_settings,
)
from streamkit.protocol.problems import Problem, SpecError, yaml_problem
from streamkit.protocol.spec import INT64, JournalSpec
from streamkit.yaml_loading import load_yaml

__all__ = ["SpecEntry", "dump_specs", "load_specs"]


# --- loading ---------------------------------------------------------------------

_SETTING_KEYS = ("replication", "labels", "fragment", "flags", "max_append_rate")
_NODE_KEYS = frozenset({"name", "children", "revision", "delete", "comment", *_SETTING_KEYS})


@dataclass(frozen=True)
class SpecEntry:
    """A journal from a spec file, with the Apply options its node gave."""

    spec: JournalSpec
    # Expected mod revision: 0 means "create", -1 means "don't check".
    revision: int = 0
    delete: bool = False


def _merge_settings(parent: dict[str, Any], node: Mapping[str, Any]) -> dict[str, Any]:
    """A node's settings over its parent's: labels merge by name, fragment fields one by one."""
    merged = dict(parent)
    for key in _SETTING_KEYS:
        if key not in node:
            continue
        value, above = node[key], parent.get(key)
        if key == "labels":
            value = merge_labels(above, value)
        elif key == "fragment" and isinstance(above, dict) and isinstance(value, dict):
            value = {**above, **value}
        merged[key] = value
    return merged


@dataclass(frozen=True)
class _Scope:
    """What a node inherits from its ancestors."""

    name: str = ""
    settings: Mapping[str, Any] = field(default_factory=dict)
    revision: int = 0
    delete: bool = False


class _TreeLoader:
    """Walks a node tree, collecting SpecEntries and every problem found on the way."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.entries: list[SpecEntry] = []
        self.problems: list[Problem] = []
        self.seen: set[str] = set()

    def fail(self, name: str | None, path: str, message: str) -> None:
        self.problems.append(Problem(message, path, name, self.source))

    def typed(self, node: Mapping[str, Any], name: str, key: str, kind: type, default: Any) -> Any:
        value = node.get(key, default)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(name, key, f"must be {'true or false' if kind is bool else 'an integer'}")
            return default
        if kind is int and not -INT64 <= value < INT64:  # (the protobuf field's range)
            self.fail(name, key, f"must be a 64-bit integer (got {value})")
            return default
        return value

    def walk(self, node: object, scope: _Scope) -> None:
        if not isinstance(node, dict):
            self.fail(scope.name, "children", f"each node must be a mapping (got {node!r})")
            return
        name = node.get("name", "")
        if not isinstance(name, str):
            self.fail(scope.name, "name", f"must be a string (got {name!r})")
            return
        for key in sorted(set(node) - _NODE_KEYS, key=str):
            self.fail(name, str(key), "unknown field")
        if not name.startswith(scope.name):
            self.fail(name, "name", f'must start with its parent\'s name "{scope.name}"')
        inner = _Scope(
            name=name,
            settings=_merge_settings(dict(scope.settings), node),
            revision=self.typed(node, name, "revision", int, scope.revision),
            delete=self.typed(node, name, "delete", bool, scope.delete),
        )
        if name == "" or name.endswith("/"):
            self.walk_directory(node, inner)
        else:
            self.add_journal(node, inner)

    def walk_directory(self, node: Mapping[str, Any], scope: _Scope) -> None:
        children = node.get("children")
        if not isinstance(children, list) or not children:
            self.fail(scope.name, "children", "a directory node needs a list of children")
            return
        if scope.revision not in (0, -1):
            self.fail(scope.name, "revision", "a directory may only carry revision -1")
        for child in children:
            self.walk(child, scope)

    def add_journal(self, node: Mapping[str, Any], scope: _Scope) -> None:
        if "children" in node:
            self.fail(
                scope.name, "children", "only directories (names ending in '/') have children"
            )
        if scope.name in self.seen:
            self.fail(scope.name, "name", "journal appears more than once")
        self.seen.add(scope.name)
        try:
            spec = JournalSpec(name=scope.name, **scope.settings)
        except SpecError as err:
            self.problems.extend(err.located(self.source).problems)
            return
        self.entries.append(SpecEntry(spec, scope.revision, scope.delete))


def load_specs(text: str, source: str = "<specs>") -> list[SpecEntry]:
    """Journals of a gazctl-style spec file, in file order.

    The document is one root node, or a list of root nodes. Raises SpecError
    listing every problem, each naming ``source``, the node and the field.
    """
    try:
        document = load_yaml(text)
    except yaml.YAMLError as err:
        raise SpecError([yaml_problem(err, source)]) from None
    if document is None:
        return []
    loader = _TreeLoader(source)
    for root in document if isinstance(document, list) else [document]:
        loader.walk(root, _Scope())
    if loader.problems:
        raise SpecError(loader.problems)
    return loader.entries


# --- dumping -----------------------------------------------------------------------


def _flatten(spec: JournalSpec) -> FlatSettings:
    """A journal's settings, one slot per fragment field and label name (see FlatSettings)."""
    flat: FlatSettings = {}
    for key, value in spec.model_dump(mode="json", exclude={"name"}).items():
        if key == "labels":
            flatten_labels(flat, value)
        elif key == "fragment":
            flat.update({("fragment", field): v for field, v in value.items()})
        else:
            flat[(key,)] = value
    return flat


def _unflatten(flat: FlatSettings) -> dict[str, Any]:
    node: dict[str, Any] = {}
    for key, value in flat.items():
        if key[0] == "labels":
            node.setdefault("labels", []).extend({"name": key[1], "value": v} for v in value)
        elif key[0] == "fragment":
            node.setdefault("fragment", {})[key[1]] = value
        else:
            node[key[0]] = value
    return node


def _directory_of(names: list[str]) -> str:
    """The longest directory ("…/" or "") holding every name."""
    shared = ""
    for segments in zip(*(name.split("/")[:-1] for name in names), strict=False):
        if any(segment != segments[0] for segment in segments):
            break
        shared += segments[0] + "/"
    return shared


def _leaf_node(entry: SpecEntry, flat: FlatSettings, scope: FlatSettings) -> dict[str, Any]:
    node = {"name": entry.spec.name, **_unflatten(settings_beyond(flat, scope))}
    if entry.revision:
        node["revision"] = entry.revision
    if entry.delete:
        node["delete"] = True
    return node


_Member = tuple[SpecEntry, FlatSettings]


def _directory_node(name: str, members: list[_Member], scope: FlatSettings) -> dict[str, Any]:
    """A directory node hoisting its members' common settings, grouping subdirectories."""
    own = settings_beyond(shared_settings([flat for _, flat in members]), scope)
    scope = {**scope, **own}
    groups: dict[str, list[_Member]] = {}
    for member in members:
        rest = member[0].spec.name[len(name) :]
        key = name + rest[: rest.find("/") + 1] if "/" in rest else member[0].spec.name
        groups.setdefault(key, []).append(member)
    children = []
    for group in groups.values():
        if len(group) == 1:
            children.append(_leaf_node(*group[0], scope))
        else:
            subdir = _directory_of([entry.spec.name for entry, _ in group])
            children.append(_directory_node(subdir, group, scope))
    children.sort(key=lambda child: child["name"])
    return {"name": name, **_unflatten(own), "children": children}


def dump_specs(entries: Iterable[SpecEntry | JournalSpec]) -> str:
    """Specs as a gazctl-style tree whose directories hoist shared settings.

    Journals come out sorted by name; ``load_specs`` reads them back as equal entries.
    """
    listed = [e if isinstance(e, SpecEntry) else SpecEntry(e) for e in entries]
    names = [entry.spec.name for entry in listed]
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise SpecError(Problem("journal appears more than once", "", name) for name in repeated)
    if not listed:
        return ""
    members = [(entry, _flatten(entry.spec)) for entry in listed]
    if len(members) == 1:
        root = _leaf_node(*members[0], scope={})
    else:
        root = _directory_node(_directory_of(names), members, scope={})
    return yaml.safe_dump(root, sort_keys=False, allow_unicode=True, default_flow_style=False)
