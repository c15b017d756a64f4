"""Guided decoding on the offline LLM (tiny random-weight checkpoint): every
output follows its constraint, bad constraints are refused at add time,
grammars compile off the engine loop and once per constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_pod import LLM, SamplingParams
from engine_pod.request import Request, RequestStatus
from tessera.structured_output import StructuredOutputsParams
from tessera_tools.bench.guided_workload import PROMPTS, SCHEMAS


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # float64: greedy tokens do not depend on the batch's composition.
    with LLM(str(tiny_llama), dtype="float64", max_model_len=512, kv_cache_memory_bytes=64 << 20) as engine:
        yield engine


def _guided(max_tokens=128, temperature=0.0, seed=None, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_100_json_schema_outputs_parse_and_validate(llm):
    cases = [(PROMPTS[i % len(PROMPTS)], SCHEMAS[i % len(SCHEMAS)]) for i in range(100)]
    # Half greedy, half sampled (seeded): both must stay inside the schema.
    params = [_guided(json=schema, temperature=0.0 if i % 2 else 1.0, seed=i) for i, (_, schema) in enumerate(cases)]
    outputs = llm.generate([p for p, _ in cases], params)
    for (prompt, schema), out in zip(cases, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (prompt, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    # Greedy outputs are not all alike: the model, not the grammar alone, chose them.
    assert len({o.outputs[0].text for o in outputs}) > len(SCHEMAS)


@pytest.mark.parametrize("pattern", [r"[a-z]{3}-\d{2,4}", r"(yes|no), because [a-z ]{1,12}\.", r"\d{4}-\d{2}-\d{2}"])
def test_regex_outputs_match(llm, pattern):
    outputs = llm.generate(PROMPTS[:8], _guided(max_tokens=48, regex=pattern))
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_choice_outputs_are_one_of_the_choices(llm):
    choices = ["Positive", "Negative", "Neutral \"quoted\"", "naïve"]
    outputs = llm.generate(PROMPTS, _guided(max_tokens=16, choice=choices))
    texts = [o.outputs[0].text for o in outputs]
    assert all(t in choices for t in texts), texts
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_grammar_and_json_object(llm):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    outputs = llm.generate(PROMPTS[:6], _guided(max_tokens=40, grammar=grammar))
    for out in outputs:
        text = out.outputs[0].text
        if out.outputs[0].finish_reason == "stop":
            assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", text), text
        else:  # the grammar allows any number of terms: a long sum may hit max_tokens
            assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\+?[0-9]*", text), text
    obj = llm.generate("{", _guided(max_tokens=16, json_object=True))[0].outputs[0]
    assert obj.text.startswith("{") and " " not in obj.text.split('"')[0]  # no free whitespace


def test_guided_and_unguided_requests_batch_together(llm):
    """The mask applies to the guided rows only: unguided greedy outputs are
    those of an unguided batch."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], plain)]
    mixed = llm.generate(PROMPTS[:6], [plain, _guided(choice=["x1", "y2"]), plain, _guided(regex="[0-9]{3}"),
                                       plain, _guided(json=SCHEMAS[0])])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    assert mixed[1].outputs[0].text in ("x1", "y2")
    assert re.fullmatch("[0-9]{3}", mixed[3].outputs[0].text)


def test_a_complete_grammar_ends_the_request_before_min_tokens(llm):
    """When the grammar allows only a stop token, min_tokens cannot ban it:
    the request ends with its valid output instead of an unsamplable row."""
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, min_tokens=10,
                                                  structured_outputs=StructuredOutputsParams(choice=["yes"])))
    assert out[0].outputs[0].text == "yes" and out[0].outputs[0].finish_reason == "stop"
    # Unconstrained, min_tokens still holds.
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, min_tokens=10))
    assert len(plain[0].outputs[0].token_ids) >= 10


def test_logprobs_are_the_raw_model_distribution(llm):
    """vLLM's default: the mask shapes what is sampled, not the logprobs reported."""
    prompt = PROMPTS[1]
    raw = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].outputs[0]
    top = raw.logprobs[0]  # token id -> Logprob, the raw distribution's top 20
    tok = llm.get_tokenizer()
    # Force a token that is not the model's first choice: its 5th.
    forced_id = sorted(top, key=lambda t: top[t].rank)[4]
    forced = tok.decode([forced_id])
    guided = llm.generate(prompt, _guided(max_tokens=1, choice=[forced]) if forced.strip() else
                          pytest.skip("5th token is blank"))
    out = guided[0].outputs[0]
    assert out.token_ids[0] == forced_id
    guided_lp = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=0,
                                                    structured_outputs=StructuredOutputsParams(choice=[forced])))
    lp = guided_lp[0].outputs[0].logprobs[0][forced_id]
    assert lp.rank == 5 and lp.logprob == pytest.approx(top[forced_id].logprob, abs=1e-5)


BAD_CONSTRAINTS = [
    (lambda: StructuredOutputsParams(json={"type": 5}), "structured_outputs.json: invalid JSON schema"),
    (lambda: StructuredOutputsParams(json="{not json"), "structured_outputs.json: the schema is not valid JSON"),
    (lambda: StructuredOutputsParams(json=["a"]), "structured_outputs.json: the schema must be a JSON object"),
    (lambda: StructuredOutputsParams(json={"enum": {1, 2}}),
     "structured_outputs.json: the schema is not JSON-serializable"),
    (lambda: StructuredOutputsParams(regex="(ab"), "structured_outputs.regex: invalid regex"),
    (lambda: StructuredOutputsParams(grammar="root ::= missing"), "structured_outputs.grammar: invalid grammar"),
    (lambda: StructuredOutputsParams(choice=[]), "structured_outputs.choice: the list of choices is empty"),
    (lambda: StructuredOutputsParams(choice="yes"), "structured_outputs.choice: must be a list of strings"),
    (lambda: StructuredOutputsParams(choice=["a", 3]), "structured_outputs.choice: every choice"),
    (lambda: StructuredOutputsParams(regex="a+", choice=["a"]), "give only one constraint, got regex and choice"),
    (lambda: StructuredOutputsParams(), "structured_outputs: give one of"),
    (lambda: StructuredOutputsParams(json_object="yes"), "structured_outputs.json_object: must be true"),
]


@pytest.mark.parametrize("make,message", BAD_CONSTRAINTS, ids=[m for _, m in BAD_CONSTRAINTS])
def test_bad_constraints_raise_value_error_naming_the_field(llm, make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=make()))
    assert not llm.engine_core.has_unfinished_requests()


def test_bad_constraint_in_a_batch_adds_nothing(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["a", "b"], [_guided(regex="[0-9]+"), _guided(regex="[0-9")])
    assert not llm.engine_core.has_unfinished_requests()
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs: must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_identical_constraint_compiles_once(llm):
    manager = llm.engine_core.structured_output
    schema = {"type": "object", "properties": {"k": {"enum": ["cache", "test"]}}, "required": ["k"]}
    before = manager.stats.num_compiles
    llm.generate(PROMPTS[:4], _guided(json=schema))
    assert manager.stats.num_compiles == before + 1  # four requests, one compile
    hits = manager.stats.num_cache_hits
    # The same schema again, written as JSON text: zero compiles.
    llm.generate(PROMPTS[4], _guided(json=json.dumps(schema, separators=(",", ":"))))
    assert manager.stats.num_compiles == before + 1
    assert manager.stats.num_cache_hits == hits + 1


def _large_grammar_choices(n: int) -> list[str]:
    return [f"option-{i:05d}-{'abcdefghij'[i % 10] * (i % 7 + 3)}" for i in range(n)]


def test_compiling_grammar_never_blocks_unguided_requests(llm):
    """A request whose grammar takes long to compile waits aside; an
    unguided request submitted after it runs and finishes first."""
    core = llm.engine_core
    slow = Request("slow", [5, 6, 7], llm.processor.process_params(
        _guided(max_tokens=32, choice=_large_grammar_choices(6000))))
    fast = Request("fast", [5, 6, 7], llm.processor.process_params(
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    core.add_request(slow)
    core.add_request(fast)
    finished: list[str] = []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finished.append(out.request_id)
                if out.request_id == "fast":
                    # The fast one is done while the slow grammar still compiles.
                    assert slow.status == RequestStatus.WAITING_FOR_FSM
                    assert slow.num_output_tokens == 0
    assert finished == ["fast", "slow"]
    assert slow.status == RequestStatus.FINISHED_STOPPED


def test_abort_while_compiling_frees_the_request(llm):
    core = llm.engine_core
    req = Request("abort-me", [5, 6], llm.processor.process_params(
        _guided(choice=_large_grammar_choices(3000))))
    core.add_request(req)
    assert req.status == RequestStatus.WAITING_FOR_FSM
    core.abort_requests(["abort-me"])
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert not core.has_unfinished_requests()
    assert "abort-me" not in core.structured_output._pending


def _guided_batch():
    # Prompts of 2-3 blocks, so a small pool fills up while outputs grow.
    prompts = [" ".join(PROMPTS[(i + k) % len(PROMPTS)] for k in range(5)) for i in range(8)]
    params = [_guided(max_tokens=96, json=SCHEMAS[i % len(SCHEMAS)]) if i % 3 else
              _guided(max_tokens=24, regex=r"[a-z]{2,6}( [a-z]{2,6}){0,3}\.") for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("engine_kwargs", [
    # Chunked prefill under a 24-token budget, prefix caching, and a pool so
    # small that requests are preempted and recomputed mid-output.
    dict(max_model_len=256, max_num_batched_tokens=24, num_gpu_blocks=16, block_size=16),
    # Two tensor-parallel ranks: the bitmask reaches the runner in the
    # scheduler output; the worker processes hold no grammar state.
    dict(max_model_len=512, kv_cache_memory_bytes=64 << 20, tensor_parallel_size=2),
], ids=["chunked-preempted", "tp2"])
def test_guided_outputs_are_invariant(llm, tiny_llama, engine_kwargs):
    prompts, params = _guided_batch()
    reference = [o.outputs[0] for o in llm.generate(prompts, params)]
    with LLM(str(tiny_llama), dtype="float64", **engine_kwargs) as other:
        outputs = [o.outputs[0] for o in other.generate(prompts, params)]
        if "num_gpu_blocks" in engine_kwargs:
            assert other.stats.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert all(o.finish_reason == "stop" for o in outputs)


def test_requests_waiting_for_their_grammar_count_as_waiting(llm):
    core = llm.engine_core
    req = Request("counted", [5, 6], llm.processor.process_params(_guided(choice=_large_grammar_choices(2500))))
    core.add_request(req)
    try:
        assert req.status == RequestStatus.WAITING_FOR_FSM
        assert core.scheduler.num_waiting == 1 and core.scheduler.make_stats().num_waiting_reqs == 1
    finally:
        core.abort_requests(["counted"])
    assert core.scheduler.num_waiting == 0


def test_an_engine_starts_without_xgrammar_and_imports_it_for_the_first_grammar(tiny_llama):
    """xgrammar and the transformers it pulls in cost an engine pod about a second of start-up:
    they are imported with the first grammar (a pod imports them in the background once it serves)."""
    import subprocess
    import sys

    script = f"""
import sys
from engine_pod import LLM, SamplingParams
from tessera.structured_output import StructuredOutputsParams
llm = LLM({str(tiny_llama)!r}, dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)
llm.generate(["hi"], SamplingParams(max_tokens=2))
assert "xgrammar" not in sys.modules, "imported before any grammar"
choice = StructuredOutputsParams(choice=["yes", "no"])
out = llm.generate(["hi"], SamplingParams(max_tokens=8, structured_outputs=choice))
assert out[0].outputs[0].text in ("yes", "no"), out[0].outputs[0].text
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
