"""Module paths that moved into sub-packages (issue 19) still import, as the new module, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest

from codesign.accel_model._moved import MOVED as ACCEL_MOVED
from codesign.dataflow._moved import MOVED as DATAFLOW_MOVED

ALL = {**ACCEL_MOVED, **DATAFLOW_MOVED}


def test_every_sub_package_module_is_listed():
    # Each module of the two sub-packages but their __init__ had an old flat name.
    assert sorted(v.rsplit(".", 1)[1] for v in DATAFLOW_MOVED.values()) == sorted(
        "space search eval engine store report cli".split()
    )
    assert sorted(v.rsplit(".", 1)[1] for v in ACCEL_MOVED.values()) == sorted(
        "control geometry memory user_gemm io cli".split()
    )


@pytest.mark.parametrize("old", sorted(ALL))
def test_old_path_is_the_new_module_with_a_deprecation_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {ALL[old]}"):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(ALL[old])
    assert mod.__name__ == ALL[old]  # pickles and tracebacks name the new path


def test_unknown_old_name_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("codesign.dataflow.explore_nothing")


def test_systolic_package_keeps_the_model_api():
    # `codesign.accel_model.systolic` was the model module; its public names are the package's.
    from codesign.accel_model import systolic
    from codesign.accel_model.systolic import model

    for name in model.__all__:
        assert getattr(systolic, name) is getattr(model, name)
