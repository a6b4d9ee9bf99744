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
activations in the decode kernels), not the quantization. With --llama-cpp-python, llama.cpp is
measured the same way (prompt, then one token a call) on the same file.
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


# The accuracy child: teacher-forces each (prompt, continuation) of a JSON file the way a request is
# served (the prompt in one batch, then one token a call) and saves the log-softmax of the rows that
# predict the continuation, one array per sequence, to an .npz.
_LLAMA_CPP_LOGPROBS = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=1024, logits_all=True, verbose=False)
out = {}
for i, (prompt, cont) in enumerate(json.load(open(sys.argv[3]))):
    llm.reset()
    llm.eval(prompt)
    for t in cont[:-1]:
        llm.eval([t])
    x = np.asarray(llm.scores[len(prompt) - 1:len(prompt) + len(cont) - 1], dtype=np.float64)
    x -= x.max(-1, keepdims=True)
    out[str(i)] = (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)
np.savez(sys.argv[4], **out)
"""


def llama_cpp_logprobs(python: str, path: str, threads: int, seqs: list) -> list[torch.Tensor]:
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/seqs.json", "w") as f:
            json.dump(seqs, f)
        subprocess.run([python, "-c", _LLAMA_CPP_LOGPROBS, path, str(threads), f"{tmp}/seqs.json", f"{tmp}/lp.npz"],
                       check=True)
        data = np.load(f"{tmp}/lp.npz")
        return [torch.from_numpy(data[str(i)]) for i in range(len(seqs))]


def kl_and_agreement(p_ref: torch.Tensor, p_q: torch.Tensor, cont: list[int]) -> tuple[float, int]:
    """(sum over rows of KL(ref || q), rows whose argmax is the continuation's token)."""
    return float((p_ref.exp() * (p_ref - p_q)).sum()), int((p_q.argmax(-1) == torch.tensor(cont)).sum())


@torch.inference_mode()
def accuracy(num_prompts: int, tokens: int, llama_cpp: tuple[str, str, int] | None) -> dict[str, tuple[float, float]]:
    """engine -> (mean KL(float32 || engine) in nats, greedy agreement), teacher-forced on the float32
    model's greedy tokens: ferrox quantized, and llama.cpp when `llama_cpp` = (python, path, threads)."""
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
    others = llama_cpp_logprobs(*llama_cpp, list(zip(prompts, greedy, strict=True))) if llama_cpp else None
    sums = {"ferrox quantized": [0.0, 0], **({"llama.cpp": [0.0, 0]} if others else {})}
    count = 0
    for i, (prompt, cont) in enumerate(zip(prompts, greedy, strict=True)):
        # The reference in one teacher-forced prefill; the quantized model as it serves: the prompt's
        # prefill, then one decode step per token (the Rust decoder and its int8 activations).
        p_ref = teacher_forced_logprobs(ref, prompt, cont, decode_steps=False)
        candidates = {"ferrox quantized": teacher_forced_logprobs(quant, prompt, cont, decode_steps=True)}
        if others:
            candidates["llama.cpp"] = others[i]
        for name, p_q in candidates.items():
            kl, agree = kl_and_agreement(p_ref, p_q, cont)
            sums[name][0] += kl
            sums[name][1] += agree
        count += len(cont)
    return {name: (kl / count, agree / count) for name, (kl, agree) in sums.items()}


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
        llama_cpp = (args.llama_cpp_python, path, threads) if "llama.cpp" in runners else None
        for name, (kl, agree) in accuracy(args.accuracy_prompts, args.accuracy_tokens, llama_cpp).items():
            print(json.dumps({"engine": name, "accuracy_prompts": args.accuracy_prompts,
                              "accuracy_tokens": args.accuracy_tokens, "mean_kl_nats": round(kl, 5),
                              "greedy_agreement": round(agree, 4)}))
    q = best["ferrox quantized"]
    print(f"cpu_quant_over_float32: {q / best['ferrox float32']:.2f}")
    print(f"cpu_quant_over_transformers: {q / best['transformers fp32']:.2f}")
    if best.get("llama.cpp"):
        print(f"cpu_quant_over_llama_cpp: {q / best['llama.cpp']:.2f}")


if __name__ == "__main__":
    main()
