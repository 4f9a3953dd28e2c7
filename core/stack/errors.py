"""Stack validation issues: each names the file, the key path, the line and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError


@dataclass(frozen=True)
class StackIssue:
    """One problem found in a stack file."""

    file: Path
    key: str  # dotted key path, "" for the whole file
    message: str
    line: int | None = None
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else f"{self.file}"
        key = f" {self.key}:" if self.key else ""
        return f"{where}: {self.severity}:{key} {self.message}"


class StackError(Exception):
    """A stack is invalid. ``issues`` holds every error found, not just the first."""

    def __init__(self, issues: list[StackIssue]) -> None:
        self.issues = issues
        errors = [i for i in issues if i.severity == "error"]
        lines = "\n".join(f"  {issue}" for issue in errors)
        super().__init__(f"{len(errors)} error(s) in stack:\n{lines}")


def _model_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The nested pydantic model that owns the field at ``loc``, when there is one."""
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return model


def describe_validation_error(model: type[BaseModel], exc: ValidationError) -> list[tuple[tuple[Any, ...], str]]:
    """(location, message) pairs with allowed keys or values spelled out."""
    described = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        kind = error["type"]
        if kind == "extra_forbidden":
            owner = _model_at(model, loc[:-1])
            allowed = ", ".join(sorted(owner.model_fields)) if owner else "(see docs/stacks.md)"
            message = f"unknown key; allowed keys: {allowed}"
        elif kind == "missing":
            message = "required key is missing"
        else:
            message = error["msg"]
            if "input" in error and not isinstance(error["input"], dict):
                message += f" (got {error['input']!r})"
            field = _model_at(model, loc[:-1])
            if field is not None and loc and loc[-1] in field.model_fields:
                info = field.model_fields[loc[-1]]
                if info.description:
                    message += f"; {loc[-1]}: {info.description}"
        # pydantic puts the validator's message after "Value error, "
        described.append((loc, message.replace("Value error, ", "")))
    return described
