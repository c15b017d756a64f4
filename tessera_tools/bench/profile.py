"""``tessera bench profile``: fit a simulated pod's step-time model
(engine_pod/sim/step_profile.py) from real steps of a real engine here.

For each chunked-prefill budget, an engine runs a seeded mix that covers
the feature space: for every batch size and prompt length a batch that
prefills (in chunks when the budget is short) and then decodes, then a
mixed batch of uneven prompt and output lengths (long prompts prefill
while short ones decode). Every non-empty step's (features, seconds in the
executor) is recorded; a seeded fraction is held back to measure the fit.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
from pathlib import Path

from engine_pod import LLM, SamplingParams
from engine_pod.core.scheduler_output import SchedulerOutput
from engine_pod.sim.step_features import step_features
from engine_pod.sim.step_profile import COEFFICIENTS, StepFeatures, fit_profile, median_abs_pct_error
from tessera_tools.bench.flags import (
    add_device_arg, add_model_args, add_output_arg, add_seed_arg, add_threads_arg, positive_float, positive_int,
    positive_int_list,
)

Sample = tuple[StepFeatures, float]


def fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text!r}")
    return value


class StepRecorder:
    """EngineCore's step_observer: keeps (features, seconds) of every step while on."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []
        self.recording = False

    def __call__(self, output: SchedulerOutput, seconds: float) -> None:
        if self.recording:
            self.samples.append((step_features(output), seconds))


def _prompt(rng: random.Random, length: int, vocab: int) -> dict:
    # Random ids above the special tokens: no prefix is shared by chance.
    return {"prompt_token_ids": [rng.randrange(16, vocab) for _ in range(length)]}


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_mix(llm: LLM, args: argparse.Namespace, rng: random.Random) -> None:
    """One engine's share of the designed mix (see the module docstring)."""
    vocab = llm.config.model.arch.vocab_size
    for batch in args.batch_sizes:
        for length in args.prompt_lens:
            lengths = [max(1, length + rng.randint(-length // 8, length // 8)) for _ in range(batch)]
            llm.generate([_prompt(rng, n, vocab) for n in lengths], _params(args.decode_len))
        lengths = [rng.randint(1, max(args.prompt_lens)) for _ in range(batch)]
        outputs = [rng.randint(1, 2 * args.decode_len) for _ in range(batch)]
        llm.generate([_prompt(rng, n, vocab) for n in lengths], [_params(m) for m in outputs])


def collect(args: argparse.Namespace) -> tuple[list[Sample], str]:
    """Drive one engine per chunked-prefill budget; the samples and the profile's source line."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    recorder = StepRecorder()
    source = ""
    needed = max(args.prompt_lens) + max(args.prompt_lens) // 8 + 2 * args.decode_len
    for budget in args.budgets:
        llm = LLM(
            args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=budget,
            kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), enable_prefix_caching=False,
            device=args.device, max_model_len=needed,
        )
        try:
            llm.engine_core.step_observer = recorder
            # The first steps pay one-off costs (allocation, kernel selection): not recorded.
            llm.generate([_prompt(rng, max(1, min(64, needed - 4)), llm.config.model.arch.vocab_size)] * 2, _params(4))
            recorder.recording = True
            run_mix(llm, args, rng)
            recorder.recording = False
            source = _source(args, llm)
        finally:
            llm.shutdown()
    return recorder.samples, source


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _source(args: argparse.Namespace, llm: LLM) -> str:
    import torch

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    return (f"tessera bench profile: model {Path(args.model).name} ({args.model}), dtype {llm.config.model.dtype}, "
            f"device {llm.config.device}, CPU {_cpu_model()} ({torch.get_num_threads()} torch threads), "
            f"budgets {','.join(map(str, args.budgets))}, seed {args.seed}, {date}")


def split(samples: list[Sample], holdout: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(fit on, held back): a seeded ``holdout`` fraction held back, at least one step each."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    num_held = min(len(samples) - 1, max(1, round(holdout * len(samples))))
    held = set(order[:num_held])
    return ([s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held])


def main(args: argparse.Namespace) -> int:
    samples, source = collect(args)
    train, held = split(samples, args.holdout, args.seed)
    if len(train) < len(COEFFICIENTS):
        raise SystemExit(f"only {len(samples)} steps recorded: widen --batch-sizes / --prompt-lens / --decode-len")
    profile = fit_profile(train, source)
    error = median_abs_pct_error(profile, held)
    print(source)
    for name in COEFFICIENTS:
        print(f"  {name:<20} {getattr(profile, name):.4g}")
    print(f"{len(samples)} steps: fitted on {len(train)}, held back {len(held)}; "
          f"held-back median absolute error {error:.1%}")
    if args.output:
        profile.save(args.output)
        print(f"\nwrote {args.output}")
    return 0


def add_parser(kinds) -> None:
    p = kinds.add_parser("profile", help="fit a simulated pod's step-time profile from real engine steps")
    add_model_args(p)
    add_seed_arg(p)
    add_output_arg(p)
    add_device_arg(p)
    add_threads_arg(p)
    p.add_argument("--batch-sizes", type=positive_int_list, default=[1, 4, 16], help="requests per batch")
    p.add_argument("--prompt-lens", type=positive_int_list, default=[16, 128, 512], help="prompt lengths (+-12%%)")
    p.add_argument("--budgets", type=positive_int_list, default=[128, 1024],
                   help="chunked-prefill budgets (max_num_batched_tokens), one engine each")
    p.add_argument("--decode-len", type=positive_int, default=16, help="tokens each batch decodes")
    p.add_argument("--holdout", type=fraction, default=0.2, help="share of steps held back to measure the fit")
    p.add_argument("--kv-cache-gib", type=positive_float, default=2.0)
    p.set_defaults(bench_func=main)
