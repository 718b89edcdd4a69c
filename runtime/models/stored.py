"""An FTW directory seen through its family: the family its spec names, that spec checked by
the family, and the dense tensors the forward pass needs against those the dense file holds.

What `ft-run` loads and what `ft-diagnose` reports about an FTW directory both come from here,
so a directory that passes the one loads in the other.
"""

from __future__ import annotations

from ..checkpoint.base import TensorRef
from ..ftw.manifest import MANIFEST, FTWError
from ..ftw.reader import FTWModel
from ..spec import ModelSpec, SpecError
from . import Family, family_for_spec


def dense_problems(family: Family, spec: ModelSpec, refs: dict[str, TensorRef]) -> tuple[list[str], list[str]]:
    """(problems, tensors the family does not use): every dense tensor the family expects must
    be stored under its canonical name with its exact shape."""
    want = family.dense_shapes(spec)
    problems = []
    for name, shape in want.items():
        ref = refs.get(name)
        if ref is None:
            problems.append(f"missing tensor: {name}")
        elif ref.shape != tuple(shape):
            problems.append(f"wrong shape: {name} is {list(ref.shape)}, expected {list(shape)}")
    return problems, [n for n in refs if n not in want]


def stored_family(model: FTWModel) -> Family:
    """The family of an opened FTW directory, its spec checked by it (FTWError naming the manifest)."""
    try:
        return family_for_spec(model.spec)
    except SpecError as e:
        raise FTWError(f"{model.path / MANIFEST}: {e}") from None


def ftw_family(model: FTWModel) -> Family:
    """`stored_family`, once the dense file holds every tensor the family needs: what loading needs."""
    family = stored_family(model)
    problems, _ = dense_problems(family, model.spec, model.dense_refs)
    if problems:
        more = f" (and {len(problems) - 1} more; run ft-diagnose)" if len(problems) > 1 else ""
        raise FTWError(f"{model.path}: {problems[0]}{more}")
    return family
