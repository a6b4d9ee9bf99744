"""OutputProcessor: n>1 fan-out/aggregation, cumulative vs delta vs final-only, logprobs, abort."""

from __future__ import annotations

from ferrox.engine.output_processor import OutputProcessor
from ferrox.engine.protocol import EngineCoreRequest, Logprobs
from ferrox.sampling_params import RequestOutputKind, SamplingParams
from ferrox.step_types import StepResult, StepRow


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


def _out(rid, toks, text, finished=False, reason=None, lp=None):
    return StepRow(rid, toks, text, reason if finished else None, new_logprobs=lp)


def test_fan_out_and_cumulative_aggregation():
    proc = OutputProcessor()
    req = EngineCoreRequest("a", [1, 2], SamplingParams(n=3, seed=10, temperature=1.0))
    children = proc.add_request(req, "hi")
    assert [c.request_id for c in children] == ["0_a", "1_a", "2_a"]
    assert [c.sampling_params.seed for c in children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 for c in children)
    (ro,) = proc.process_outputs(StepResult.from_rows([_out("1_a", [5], "x")]))
    assert not ro.finished and [o.text for o in ro.outputs] == ["", "x", ""]
    proc.process_outputs(StepResult.from_rows([_out("0_a", [6], "y", True, "stop"), _out("1_a", [7], "z", True, "length")]))
    assert proc.has_unfinished_requests()
    (ro,) = proc.process_outputs(StepResult.from_rows([_out("2_a", [8, 9], "w", True, "stop")]))
    assert ro.finished and ro.prompt == "hi" and ro.prompt_token_ids == [1, 2]
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in ro.outputs] == [
        (0, "y", [6], "stop"), (1, "xz", [5, 7], "length"), (2, "w", [8, 9], "stop"),
    ]
    assert not proc.has_unfinished_requests()


def test_delta_mode_reports_only_news():
    proc = OutputProcessor()
    proc.add_request(EngineCoreRequest("d", [1], SamplingParams(n=2, output_kind=RequestOutputKind.DELTA)))
    (ro,) = proc.process_outputs(StepResult.from_rows([_out("0_d", [3], "a"), _out("1_d", [4], "b")]))
    assert [(o.index, o.text) for o in ro.outputs] == [(0, "a"), (1, "b")]
    (ro,) = proc.process_outputs(StepResult.from_rows([_out("0_d", [5], "c", True, "stop")]))
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in ro.outputs] == [(0, "c", [5], "stop")]
    (ro,) = proc.process_outputs(StepResult.from_rows([_out("1_d", [6], "e", True, "length")]))
    assert ro.finished and [(o.index, o.text) for o in ro.outputs] == [(1, "e")]


def test_final_only_and_logprobs():
    proc = OutputProcessor(_Tok())
    proc.add_request(EngineCoreRequest("f", [1], SamplingParams(logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY)))
    lp1 = Logprobs([3], [-0.5], [1], [[3]], [[-0.5]])
    lp2 = Logprobs([4], [-2.0], [3], [[9]], [[-0.1]])
    assert proc.process_outputs(StepResult.from_rows([_out("f", [3], "a", lp=lp1)])) == []
    (ro,) = proc.process_outputs(StepResult.from_rows([_out("f", [4], "b", True, "stop", lp=lp2)]))
    out = ro.outputs[0]
    assert out.text == "ab" and out.token_ids == [3, 4]
    assert out.cumulative_logprob == -2.5
    assert out.logprobs is not None and len(out.logprobs) == 2
    assert out.logprobs[1][4].rank == 3 and out.logprobs[1][9].logprob == -0.1
    assert out.logprobs[1][9].decoded_token == "<9>"


def test_abort_returns_unfinished_children_and_drops_late_outputs():
    proc = OutputProcessor()
    proc.add_request(EngineCoreRequest("x", [1], SamplingParams(n=2)))
    proc.process_outputs(StepResult.from_rows([_out("0_x", [1], "", True, "stop")]))
    assert proc.abort_requests(["x", "unknown"]) == ["1_x"]
    assert proc.process_outputs(StepResult.from_rows([_out("1_x", [2], "late")])) == []
    assert not proc.has_unfinished_requests()


def test_step_result_columns_round_trip_and_concat():
    """StepResult is what crosses the process boundary: msgpack round trip and concat keep every row."""
    import msgspec

    a = StepResult.from_rows([_out("a", [1, 2], "hé", lp=Logprobs([2], [-0.5], [1], [[2]], [[-0.5]])),
                              _out("b", [], "", True, "abort")])
    b = StepResult.from_rows([StepRow("c", [7], "x", "stop", stop_reason="\n", error=None),
                              StepRow("d", finish_reason="error", error="boom")])
    both = StepResult.concat([a, StepResult(), b])
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(both), type=StepResult)
    assert wire.rows() == a.rows() + b.rows()
    assert wire.finished_req_ids() == ["b", "c", "d"]
    assert wire.rows()[0].text_delta == "hé" and wire.rows()[2].stop_reason == "\n"
