"""The extension without PyTorch: build info, GLU row orders, error mapping."""

import moe_engine
from moe_engine import _C


def test_build_info_and_version():
    info = moe_engine.build_info()
    assert info["version"] == moe_engine.__version__
    assert isinstance(info["with_cuda"], bool)
    assert isinstance(moe_engine.gpus(), list)


def test_glu_row_permutation_matches_the_layouts():
    F = 4
    # halves -> pairs: gate j at 2j (from row j), linear j at 2j+1 (from row F+j)
    assert _C.glu_row_permutation("halves", "pairs", F) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert _C.glu_row_permutation("halves", "blocks:2", F) == [0, 1, 4, 5, 2, 3, 6, 7]
    assert _C.glu_row_permutation("pairs", "pairs", F) == list(range(8))
    assert _C.glu_layout_name("blocks:32") == "blocks:32"


def test_bad_arguments_raise_value_errors_with_the_code():
    import pytest

    with pytest.raises(ValueError, match="unknown GLU layout"):
        _C.glu_layout_name("diagonal")
    with pytest.raises(ValueError, match="F divisible"):
        _C.glu_row_permutation("halves", "blocks:3", 4)
