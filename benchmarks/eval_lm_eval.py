"""lm-eval generation: lm-eval's own HF backend vs `run_lm_eval` on swiftlm's engine, side by
side in one run, same model, same task, same greedy answers.

    python benchmarks/eval_lm_eval.py [--model PATH] [--prompts 48] [--max_gen_toks 64]
                                      [--batch_size 16] [--max_num_seqs 64] [--chat]
                                      [--repeat 3]

The task is a local lm-eval `generate_until` task the script writes (short questions, stop
strings "\\n\\n" and "Question:", like GSM8K's), run through `lm_eval.simple_evaluate` twice:
with `HFLM` (`--model hf`, `batch_size` as a user sets it) and with swiftlm's `EngineLM`.
Both models load before the clocks start, so the times are evaluation only; the two run
alternately `--repeat` times and the fastest run of each counts (a shared machine only ever
adds time). Default model: the packaged SmolLM2-135M-Instruct, from the Hugging Face folder
swiftlm converts its GGUF to (`models.loader.resolve_model`), which lm-eval's HF loads too.

Where the speed comes from: HF's backend pads each batch to its longest prompt and decodes
until the batch's *last* answer stops (finished rows keep occupying the batch), batch after
batch; the engine decodes every prompt at once and frees a row the step its answer stops.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOPICS = ["the ocean", "volcanoes", "the moon", "bees", "rivers", "deserts", "owls", "glaciers"]
TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n", "Question:"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2)")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max_gen_toks", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=16, help="lm-eval HF backend's batch")
    parser.add_argument("--max_num_seqs", type=int, default=64, help="engine rows per step")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest counts")
    return parser.parse_args()


def question(i: int) -> str:
    """Varied questions: some answered in a line, some in a list that runs to the limit."""
    kind = i % 4
    topic = TOPICS[i % len(TOPICS)]
    if kind == 0:
        return f"What is {i + 3} plus {2 * i + 5}?"
    if kind == 1:
        return f"Name one animal that lives near {topic}."
    if kind == 2:
        return f"List {i % 5 + 3} facts about {topic}."
    return f"In one word, is {topic} hot or cold?"


def write_task(folder: Path, prompts: int, max_gen_toks: int) -> str:
    rows = [{"question": question(i), "answer": ""} for i in range(prompts)]
    data = folder / "bench_gen.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = folder / "bench_gen.yaml"
    text = TASK_YAML.format(
        name="swiftlm_bench_gen", data=data, cache=folder / "cache", max_gen_toks=max_gen_toks
    )
    path.write_text(text)
    return str(path)


def evaluate(lm, task_file: str, chat: bool) -> tuple[dict[str, float], list[str]]:
    """Seconds `simple_evaluate` took on `lm` (`total`: building the task, generating,
    scoring) and its `generate_until` call took (`generate`: wall, `generate_cpu`: CPU time
    of all this process's threads, stretched less than wall time by other processes on the
    cores), and the answers in document order."""
    import lm_eval

    from swiftlm.evaluation.lm_eval_bridge import resolve_tasks, task_manager

    names, folders = resolve_tasks([task_file])
    manager = task_manager(names, folders)
    seconds = {}
    generate_until = lm.generate_until

    def timed(requests, *args, **kwargs):
        start, cpu_start = time.perf_counter(), time.process_time()
        answers = generate_until(requests, *args, **kwargs)
        seconds["generate"] = time.perf_counter() - start
        seconds["generate_cpu"] = time.process_time() - cpu_start
        return answers

    lm.generate_until = timed  # simple_evaluate looks the method up on the instance
    start = time.perf_counter()
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=manager,
            apply_chat_template=chat,
            bootstrap_iters=0,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )
    finally:
        del lm.generate_until  # the class's method again, for the next repeat
    seconds["total"] = time.perf_counter() - start
    samples = sorted(results["samples"][names[0]], key=lambda s: s["doc_id"])
    return seconds, [s["resps"][0][0] for s in samples]


def load_hf(path: str, args, device: str):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=path, dtype=args.dtype, device=device, batch_size=args.batch_size)


def load_swiftlm(path: str, args):
    from swiftlm.engine.build import build_engine
    from swiftlm.evaluation.lm_eval_bridge import engine_lm

    engine = build_engine(
        path, torch_dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs
    )
    return engine, engine_lm(engine)


def report(args, model_name, device, hf, ours, answers_hf, answers_ours, tokenizer) -> None:
    tokens = [len(tokenizer(a)["input_ids"]) for a in answers_ours]
    same = sum(a == b for a, b in zip(answers_hf, answers_ours, strict=True))
    print(
        f"\nmodel {model_name}, {args.dtype} on {device}, {args.prompts} prompts, "
        f"max_gen_toks {args.max_gen_toks}, chat template {'on' if args.chat else 'off'}"
    )
    print(
        f"answers: mean {sum(tokens) / len(tokens):.1f} tokens after the cut, "
        f"{sum(t >= args.max_gen_toks - 1 for t in tokens)} ran to max_gen_toks"
    )
    columns = ("total", "generate", "generate_cpu")
    print(f"\n| {'backend':<40} | {'total s':>7} | {'generate s':>10} | {'gen CPU s':>9} |")
    print(f"|{'-' * 42}|{'-' * 9}|{'-' * 12}|{'-' * 11}|")
    for name, seconds in (
        (f"lm-eval HF backend (batch_size {args.batch_size})", hf),
        (f"swiftlm engine (max_num_seqs {args.max_num_seqs})", ours),
    ):
        total, generate, cpu = (seconds[c] for c in columns)
        print(f"| {name:<40} | {total:>7.2f} | {generate:>10.2f} | {cpu:>9.2f} |")
    ratios = ", ".join(f"{c} {hf[c] / ours[c]:.2f}x" for c in columns)
    print(f"\nspeed-up (HF seconds / swiftlm seconds): {ratios}")
    print(f"identical answers: {same}/{len(answers_ours)}")
    for i, (a, b) in enumerate(zip(answers_hf, answers_ours, strict=True)):
        if a != b:
            print(f"  first difference, doc {i}:\n    HF:      {a!r}\n    swiftlm: {b!r}")
            break


def fastest(runs: list[dict[str, float]]) -> dict[str, float]:
    """The repeat whose generation was fastest: other processes on the cores only ever add
    time, so it is the least disturbed measurement."""
    return min(runs, key=lambda run: run["generate"])


def record_work(engine) -> dict:
    """Wrap `engine.generate` to keep each request's prompt and its generated length."""
    work = {}
    generate = engine.generate

    def recorded(requests):
        results = generate(requests)
        work["prompts"] = [request.prompt_ids for request in requests]
        work["lengths"] = [len(samples[0].token_ids) for samples in results]
        return results

    engine.generate = recorded
    return work


def decode_work(work: dict, batch_size: int, tokenizer) -> str:
    """Decode steps and row-steps (rows x steps) each side runs for the same answers. HF's
    backend sorts prompts longest first and runs each batch until its longest answer ends;
    the engine runs each row until its own answer ends. On a CPU a step costs about its rows
    (compute-bound), so row-steps predict the ratio; on a GPU a step costs about the same
    for any batch, so steps do."""
    prompts, lengths = work["prompts"], work["lengths"]
    order = sorted(
        range(len(prompts)), key=lambda i: (-len(prompts[i]), tokenizer.decode(prompts[i]))
    )
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    hf_steps = sum(max(lengths[i] for i in batch) for batch in batches)
    hf_rows = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)
    return (
        f"decode work: HF backend {hf_steps} steps, {hf_rows} row-steps; swiftlm engine "
        f"{max(lengths)} steps, {sum(lengths)} row-steps (ratios {hf_steps / max(lengths):.2f}x "
        f"and {hf_rows / sum(lengths):.2f}x)"
    )


def main() -> None:
    args = parse_args()
    import torch

    from swiftlm.models.loader import pick_device, resolve_model

    resolved = resolve_model(args.model)
    device = str(pick_device(args.device))
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as folder:
        task_file = write_task(Path(folder), args.prompts, args.max_gen_toks)
        engine, ours_lm = load_swiftlm(resolved.path, args)
        work = record_work(engine)
        hf_lm = load_hf(resolved.path, args, device)
        # Warm-up: the first forwards of new shapes are slow (oneDNN/cuBLAS set-up); the engine
        # had its warm-up in build_engine.
        hf_lm.model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=2)
        ours_runs, hf_runs = [], []
        try:
            for _ in range(args.repeat):  # alternating, so both see the same disturbances
                seconds, answers_ours = evaluate(ours_lm, task_file, args.chat)
                ours_runs.append(seconds)
                seconds, answers_hf = evaluate(hf_lm, task_file, args.chat)
                hf_runs.append(seconds)
        finally:
            engine.shutdown()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    ours, hf = fastest(ours_runs), fastest(hf_runs)
    report(args, resolved.name, device, hf, ours, answers_hf, answers_ours, engine.tokenizer)
    print(decode_work(work, args.batch_size, engine.tokenizer))


if __name__ == "__main__":
    main()
