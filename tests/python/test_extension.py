"""The extension without PyTorch: build info, GLU row orders, error mapping, the GLU spec, the
training contract's decisions (against the tables in tests/data that the C++ tests read too), and
DLPack arrays that are not torch tensors."""

import json
import re
from pathlib import Path

import pytest

import moe_engine
from moe_engine import _C

DATA = Path(__file__).resolve().parent.parent / "data"


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
    with pytest.raises(ValueError, match="unknown GLU layout"):
        _C.glu_layout_name("diagonal")
    with pytest.raises(ValueError, match="F divisible"):
        _C.glu_row_permutation("halves", "blocks:3", 4)


# ---- the training contract's decisions, against the tables the C++ tests read too ----


def table(name):
    return json.loads((DATA / name).read_text())


def test_grad_outcome_is_the_shared_table():
    rows = table("grad_contract.json")["rows"]
    assert len(rows) >= 6
    for r in rows:
        o = _C.grad_outcome(r["main_grad"], r["overwrite"], r["zero_out"], r["delay"], r["flag"])
        got = (o.deferred, o.target, o.mode, o.handed_back, o.zero_dummy, o.flag)
        want = (r["deferred"], r["target"], r["mode"], r["handed_back"], r["zero_dummy"], r["flag_update"])
        assert got == want, r["name"]


def test_offload_schedule_is_the_shared_table():
    t = table("offload_schedule.json")
    for c in t["stacks"]:
        s = _C.OffloadSchedule(c["num_layers"], c["offload_layers"], c["min_bytes"])
        assert s.offload_layers == c["resolved_offload_layers"]
        assert [_C.OffloadSchedule.released_at_forward(i) for i in range(c["num_layers"])] == c["released_at_forward"]
        assert [_C.OffloadSchedule.release_after_kept_reload(i) for i in range(c["num_layers"])] == \
            c["release_after_kept_reload"]
        for layer, nbytes, opted_out, want in c["offloads"]:
            assert s.offloads(layer, nbytes, opted_out) == want, (layer, nbytes, opted_out)
        for b in c["backward"]:
            assert s.at_backward(b["layer"], b["first"]) == (b["release"], b["reload"]), b
    for e in t["errors"]:
        with pytest.raises(ValueError, match=re.escape(e["message"])):
            _C.OffloadSchedule(e["num_layers"], e["offload_layers"], e["min_bytes"])


def test_plan_grouped_keys_decides_on_shapes_alone():
    f32 = "float32"
    per_expert = {"w0": ((2, 3), f32), "w1": ((2, 3), f32), "w2": ((2, 3), f32)}
    p = _C.plan_grouped_keys(per_expert, "w", 3, "packed")
    assert (p.action, p.shape, p.missing, p.error) == ("stack", [3, 2, 3], [], "")
    assert _C.plan_grouped_keys(per_expert, "w", 3, "per-expert").action == "keep"
    p = _C.plan_grouped_keys({"w": ((6, 3), f32)}, "w", 3, "per-expert")
    assert (p.action, p.shape) == ("split", [2, 3])
    assert _C.plan_grouped_keys({"w": ((6, 3), f32)}, "w", 3, "packed").action == "keep"
    p = _C.plan_grouped_keys({"w": ((6, 3), f32)}, "w", 3, "packed", [2, 3])
    assert (p.action, p.shape) == ("reshape", [3, 2, 3])
    assert _C.plan_grouped_keys({"w0": ((2,), f32)}, "w", 3, "packed").missing == ["w1", "w2"]
    p = _C.plan_grouped_keys({"w": ((7, 3), f32)}, "w", 3, "per-expert")
    assert p.action == "keep" and "cannot split checkpoint key 'w' [7, 3] float32" in p.error
    p = _C.plan_grouped_keys({"w0": ((2,), f32), "w1": ((3,), f32), "w2": ((2,), f32)}, "w", 3, "packed")
    assert "checkpoint key 'w1' is [3] float32, but 'w0' is [2] float32" in p.error
    with pytest.raises(ValueError, match="unknown expert layout|packed"):
        _C.plan_grouped_keys({}, "w", 3, "diagonal")


# ---- the GLU spec: one value, one string across the dispatcher ----


def test_glu_spec_round_trips_through_its_text():
    s = _C.GluSpec("clamped_qgeglu", "blocks:32", 7.0, 1.702, 1.0)
    assert s.text == "activation=clamped_qgeglu,layout=blocks:32,limit=7,alpha=1.702,offset=1"
    assert _C.GluSpec.parse(s.text) == s
    assert (s.activation, s.layout) == ("clamped_qgeglu", "blocks:32")
    odd = _C.GluSpec("swiglu", "pairs", 0.1, 3.3333333, -2.5e-7)
    back = _C.GluSpec.parse(odd.text)
    assert (back.limit, back.alpha, back.offset) == (odd.limit, odd.alpha, odd.offset)  # float32, exactly
    assert back != s
    d = _C.GluSpec.parse("activation=swiglu")  # the rest: the defaults
    assert d == _C.GluSpec() and d.layout == "halves"
    assert repr(d) == f"GluSpec.parse('{d.text}')"


@pytest.mark.parametrize("text, words", [
    ("activation=swiglu,colour=red", "unknown item 'colour'"),
    ("activation=swiglu,limit=seven", "'seven' is not a number"),
    ("swiglu", "no '=' in 'swiglu'"),
    ("activation=relu", "activation"),
    ("layout=blocks:3x", "layout"),
])
def test_a_bad_glu_spec_names_what_is_wrong(text, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        _C.GluSpec.parse(text)


# ---- tensors across the extension without torch (nanobind's own DLPack import) ----


def test_numpy_arrays_are_tensor_arguments_too():
    np = pytest.importorskip("numpy")
    a = np.zeros((2, 3), dtype=np.float32)
    info = _C.tensor_info(a)
    assert (info["dtype"], info["shape"], info["strides"], info["device"]) == ("float32", [2, 3], [3, 1], "cpu")
    assert info["data"] == a.ctypes.data
    assert _C.tensor_info(a.T)["strides"] == [1, 3]
    assert _C.tensor_info(np.zeros(4, dtype=np.uint8))["dtype"] == "uint8"
    with pytest.raises(ValueError, match=r"tensor_info: t: unsupported dtype int16; expected one of"):
        _C.tensor_info(np.zeros(2, dtype=np.int16))
    with pytest.raises(TypeError, match="tensor_info"):
        _C.tensor_info("not a tensor")


def test_a_routing_is_made_only_by_route():
    with pytest.raises(TypeError):
        _C.Routing()
