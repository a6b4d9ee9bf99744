"""CPU benchmark of the embedded SmolLM2-135M (Q4_1 GGUF) kept quantized: speed and accuracy.

    .venv/bin/python benches/bench_cpu_quant.py [--tokens 128] [--repeat 3] [--threads N]
        [--llama-cpp-python /tmp/llamacpp_venv/bin/python] [--skip-accuracy]

Speed, single stream, greedy, ignore_eos, --tokens new tokens, interleaved repetitions (best of
each, as the least disturbed on a shared machine), all in one run:
- ferrox quantized: `LLM()` (dtype auto: the GGUF's blocks repacked for torch's int4 matmul);
- ferrox float32: `LLM(dtype="float32")` (the blocks dequantized, as before);
- transformers float32 `generate` on the same file;
- llama.cpp (llama-cpp-python) on the same file, in a child process of the interpreter given by
  --llama-cpp-python (built into its own venv, never ferrox's); skipped when not given.
Accuracy: 16 prompts x 64 tokens greedy from the float32 model, both models teacher-forced on
them (the quantized one in decode steps, as it serves): mean per-token KL(float32 || quantized) of
the next-token distributions, and how often the quantized argmax is the float32 greedy token. The
float32 model is itself the dequantized Q4_1 file, so this measures the kernel path (int8
activations in the decode kernels), not the quantization.
Ratios print last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.helpers.driver
from bench_cpu import BATCH_PROMPTS, PROMPT, TransformersRunner  # noqa: E402


class FerroxRunner:
    def __init__(self, dtype: str, threads: int) -> None:
        from ferrox import LLM, SamplingParams

        self.llm = LLM(dtype=dtype, kv_cache_memory=512 << 20, num_threads=threads)
        self.params = SamplingParams
        self.llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up

    def run(self, tokens: int) -> float:
        params = self.params(temperature=0, max_tokens=tokens, ignore_eos=True)
        self.llm.reset_prefix_cache()
        t = time.perf_counter()
        out = self.llm.generate([PROMPT], params, use_tqdm=False)
        return len(out[0].outputs[0].token_ids) / (time.perf_counter() - t)


class TransformersSingle:
    def __init__(self) -> None:
        self.hf = TransformersRunner()

    def run(self, tokens: int) -> float:
        return self.hf.run([PROMPT], tokens)


# The child: loads the GGUF once, then for each line "N" on stdin generates N tokens and prints tok/s.
_LLAMA_CPP_CHILD = r"""
import sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=512, verbose=False)
def run(n):
    llm.reset()
    t = time.perf_counter()
    out = llm(sys.argv[3], max_tokens=n, temperature=0.0, top_k=1, logit_bias={})
    done = out["usage"]["completion_tokens"]
    return done / (time.perf_counter() - t), done
run(8)
print("ready", flush=True)
for line in sys.stdin:
    rate, done = run(int(line))
    print(f"{rate} {done}", flush=True)
"""


class LlamaCppRunner:
    """llama.cpp cannot be told to ignore EOS through this call, so its rate is over the tokens it
    did produce (printed; with this prompt it runs the full length)."""

    def __init__(self, python: str, path: str, threads: int) -> None:
        self.proc = subprocess.Popen([python, "-c", _LLAMA_CPP_CHILD, path, str(threads), PROMPT],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("llama.cpp child failed to start")
        self.produced = 0

    def run(self, tokens: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{tokens}\n")
        self.proc.stdin.flush()
        rate, done = self.proc.stdout.readline().split()
        self.produced = int(done)
        return float(rate)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@torch.inference_mode()
def accuracy(num_prompts: int, tokens: int) -> tuple[float, float]:
    """(mean KL(float32 || quantized) in nats, greedy agreement) over teacher-forced float32 greedy."""
    from ferrox.loader.model_loader import load_model, load_model_spec
    from ferrox.loader.source import resolve_model
    from ferrox.loader.tokenizer import load_tokenizer

    from tests.helpers.driver import run_greedy, teacher_forced_logprobs

    source = resolve_model(None)
    spec, tok = load_model_spec(source), load_tokenizer(source)
    ref = load_model(source, spec, dtype=torch.float32, device="cpu")
    quant = load_model(source, spec, dtype=torch.float32, device="cpu", keep_quantized=True)
    prompts = [tok.encode(p) for p in BATCH_PROMPTS[:num_prompts]]
    greedy = run_greedy(ref, prompts, tokens)
    kl_sum, agree, count = 0.0, 0, 0
    for prompt, cont in zip(prompts, greedy, strict=True):
        # The reference in one teacher-forced prefill; the quantized model as it serves: the prompt's
        # prefill, then one decode step per token (the Rust decoder and its int8 activations).
        p_ref = teacher_forced_logprobs(ref, prompt, cont, decode_steps=False)
        p_q = teacher_forced_logprobs(quant, prompt, cont, decode_steps=True)
        kl_sum += float((p_ref.exp() * (p_ref - p_q)).sum())
        agree += int((p_q.argmax(-1) == torch.tensor(cont)).sum())
        count += len(cont)
    return kl_sum / count, agree / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch / llama.cpp threads (default: all cores)")
    ap.add_argument("--llama-cpp-python", default=None, help="a python with llama_cpp installed")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--accuracy-prompts", type=int, default=16)
    ap.add_argument("--accuracy-tokens", type=int, default=64)
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)

    from ferrox.loader.source import resolve_model

    path = resolve_model(None).path
    runners: dict[str, object] = {"ferrox quantized": FerroxRunner("auto", threads),
                                  "ferrox float32": FerroxRunner("float32", threads)}
    torch.set_num_threads(threads)
    runners["transformers fp32"] = TransformersSingle()
    if args.llama_cpp_python:
        try:
            runners["llama.cpp"] = LlamaCppRunner(args.llama_cpp_python, path, threads)
        except Exception as e:  # the build or the binary: say so, measure the rest
            print(f"llama.cpp: not measured ({type(e).__name__}: {e})", flush=True)
    best = dict.fromkeys(runners, 0.0)
    for rep in range(args.repeat):
        for name, runner in runners.items():
            best[name] = max(best[name], runner.run(args.tokens))  # type: ignore[attr-defined]
        print(f"rep {rep}: " + "  ".join(f"{k} {v:.1f}" for k, v in best.items()) + " (best so far)", flush=True)
    llama = runners.get("llama.cpp")
    if isinstance(llama, LlamaCppRunner):
        print(f"llama.cpp produced {llama.produced} tokens per run")
        llama.close()

    print(f"\nCPU, SmolLM2-135M-Instruct (embedded Q4_1 GGUF), {threads} threads, single stream, {args.tokens} new "
          "tokens, greedy")
    print(f"| {'engine':<18} | {'tok/s':>8} |")
    print(f"|{'-' * 20}|{'-' * 10}|")
    for name, rate in best.items():
        print(f"| {name:<18} | {rate:>8.1f} |")
    if not args.skip_accuracy:
        kl, agree = accuracy(args.accuracy_prompts, args.accuracy_tokens)
        print(json.dumps({"accuracy_prompts": args.accuracy_prompts, "accuracy_tokens": args.accuracy_tokens,
                          "mean_kl_nats": round(kl, 5), "greedy_agreement": round(agree, 4)}))
    q = best["ferrox quantized"]
    print(f"cpu_quant_over_float32: {q / best['ferrox float32']:.2f}")
    print(f"cpu_quant_over_transformers: {q / best['transformers fp32']:.2f}")
    if best.get("llama.cpp"):
        print(f"cpu_quant_over_llama_cpp: {q / best['llama.cpp']:.2f}")


if __name__ == "__main__":
    main()
