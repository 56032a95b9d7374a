"""Config: JSON round trips for the frozen dataclasses the tuner stores, and Candidate."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

T = TypeVar("T", bound="Config")


class Config:
    """Base for frozen dataclasses of JSON-able fields: to_json / from_json / save / load."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}; expected {sorted(names)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls: type[T], path: str | Path) -> T:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Candidate(Config):
    """One thing the tuner can time: a backend and one parameter set from its tuning space."""

    backend: str
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # JSON brings params back as lists of lists; the key must stay hashable and ordered.
        object.__setattr__(self, "params", tuple(sorted((str(k), v) for k, v in self.params)))

    @classmethod
    def of(cls, backend: str, params: Mapping[str, Any] | None = None) -> Candidate:
        return cls(backend, tuple((params or {}).items()))

    @functools.cached_property
    def params_dict(self) -> Mapping[str, Any]:
        """The parameters as a read-only mapping (made once: every conv call of a layer passes it)."""
        return MappingProxyType(dict(self.params))

    @functools.cached_property
    def id(self) -> str:
        """``backend`` or ``backend[k=v,...]``: the name shown in logs and stored in the cache."""
        if not self.params:
            return self.backend
        return f"{self.backend}[{','.join(f'{k}={v}' for k, v in self.params)}]"
