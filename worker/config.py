"""The worker's one settings object: every field is a CLI flag (``--claim-idle-ms``) and an environment
variable (``DQ_CLAIM_IDLE_MS``); flags win over the environment, the environment over the defaults written
here.

Every field is checked when the object is made (ranges, choices, the fast path's words): a bad value is a
SettingsError naming the flag, the variable and what is allowed, and ``python -m worker serve`` exits 2 on it
before the model loads."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
from dataclasses import dataclass, field, fields
from typing import Any

from producer.plumbing.connection import (MAX_WAIT_REPLICAS, SCHEMES, SOCKET_TIMEOUT, mode_problem,
                                      redact, tls_url, url_problem)
from producer.plumbing.sentinel import credentials, is_sentinel
from producer.wire.keys import MODEL_NAME

from .fast_options import CHECKED, COMPILE_MODES, DEFAULT_EPILOGUES

DEVICE = re.compile(r"(auto|cpu|cuda(:[0-9]+)?)")
# --gpus; worker/launch/launcher.py reads it
GPUS = re.compile(r"|all|cpu:[1-9][0-9]{0,2}|[0-9]{1,3}(,[0-9]{1,3})*")
NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a prefix of every key: no braces (hash tags), no colons
REDIS_SCHEMES = tuple(f"{scheme}://" for scheme in SCHEMES)


class SettingsError(ValueError):
    """A setting out of its range or choices, named by its flag and variable."""


# The help's sections: each starts at this field and runs to the next one's (fields keep their order).
SECTIONS = {"checkpoint": "model", "pack_tokens": "packing, planning and the GPU fast path",
            "redis_url": "Redis connection", "shard": "queue",
            "metrics_port": "operations (metrics, health, logs)"}
ALIASES = {"redis_url": ("--redis",), "redis_cluster": ("--cluster",)}  # dq-producer's spellings too
# switches: --x and --no-x; one that may stay unset (None) is decided where the worker starts
OPTIONAL_SWITCH = "bool | None"
BOOLEANS = ("bool", OPTIONAL_SWITCH)
# a flag given again adds to the list (its variable: the names, comma-separated)
REPEATED = ("served_model_name",)


def _opt(default: Any, help: str, choices: tuple[str, ...] = (), low: float | None = None,
         high: float | None = None, more: str = "") -> Any:
    """A field; ``choices`` (matched ignoring case), ``low`` and ``high`` (inclusive) are checked on creation.
    ``more``: what docs/CONFIGURATION.md adds to ``help`` (ops/configuration.py writes it from these
    fields)."""
    return field(default=default, metadata={"help": help, "choices": choices, "low": low, "high": high,
                                            "more": more})


@dataclass(frozen=True)
class Settings:
    """The worker's settings, each a flag and a variable, every one checked when the object is made."""

    # Model
    checkpoint: str = _opt("", "decision checkpoint directory (any format transformers.decision loads)")
    served_model_name: str = _opt("", "a name the model is served under; repeat the flag (or separate by "
                                      "commas) for aliases; the first is the one results say (empty: the "
                                      "checkpoint's own name)",
                                  more="the gateway routes System One calls by these names (docs/GATEWAY.md)")
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    gpus: str = _opt("", "one worker process per GPU, started and supervised by this one: all, a list like "
                         "0,1,3, or cpu:N (N CPU workers: tests, CPU hosts); empty: this process is the "
                         "worker",
                more="docs/OPERATIONS.md, \"One host, many GPUs\"")
    dtype: str = _opt("auto", "auto (bfloat16 on cuda, float32 on cpu), bfloat16, float16 or float32",
                      choices=("auto", "bfloat16", "float16", "float32"))
    engine: str = _opt("auto", "auto (fast on cuda, reference on cpu), fast or reference",
                       choices=("auto", "fast", "reference"))
    deterministic: bool | None = _opt(None, "a request's logits depend on the request alone, bitwise, never "
                                            "on what shares its pack or which worker ran it (unset: on "
                                            "wherever its kernels run, the fast engine on Hopper or "
                                            "Blackwell; --no-deterministic turns it off)",
                                      more="the same kernels for every bucket on the GPU, each prompt alone on "
                                           "the CPU (on there only when asked); the worker logs at start "
                                           "which it runs and why; docs/RELIABILITY.md, \"Deterministic "
                                           "mode\"")
    max_prompt_tokens: int = _opt(0, "longest prompt (0: the model's context); a request whose prompt is "
                                     "longer is split by question, a shorter one runs whole", low=0,
                                more="one over --pack-tokens runs alone, eagerly: set both alike to keep "
                                     "every prompt in one pack; a split request's result says usage.split "
                                     "(docs/PROTOCOL.md)")
    fanout_tokens: int = _opt(8192, "requests of more tokens than this (several prompts) fan out to all "
                                    "workers", low=1)
    # Packing and the fast path
    pack_tokens: int = _opt(16384, "token budget of one forward pass; with CUDA graphs also the largest "
                                   "bucket (--buckets above it are dropped)", low=1,
                            more="lower it for shorter packs, with graphs or without")
    max_wait_ms: float = _opt(0.0, "longest a partly filled pack waits for more work before it runs on an "
                                   "idle GPU (0: at once; under load the running pack gathers the next)", low=0)
    normal_share: float = _opt(0.1, "share of each pack's tokens kept for normal-priority work while some "
                                    "waits (high work never starves it)", low=0.01, high=0.9)
    high_target_ms: float = _opt(100.0, "latency a high-priority request should see in this worker (taken "
                                        "to answers read out): the pack it rides in is sized for its oldest "
                                        "one", low=1,
                                 more="the pack policy, worker/gpu/policy.py: docs/BENCHMARKS.md, \"The "
                                      "pack policy\"")
    buckets: str = _opt("512,1024,2048,4096,8192,16384", "static pack sizes captured as CUDA graphs (fast "
                        "path), those below --pack-tokens kept, --pack-tokens always one; a pack pays for "
                        "its bucket")
    cuda_graphs: bool = _opt(True, "replay packs through CUDA graphs (fast path)")
    compile: str = _opt("layer", "torch.compile mode (fast path): none, sub or layer", choices=COMPILE_MODES)
    prune_last: bool = _opt(True, "last layer computes only the marker rows (fast path)")
    fp8: bool = _opt(False, "FP8 rowwise matmuls (fast path, Hopper)")
    fp8_layers: str = _opt("all", "layers fp8 converts: all, full (full-attention), linear, late (the second "
                                  "half: within twice bf16's error at 2B), or indices like 0-5,18",
                       more="fidelity and speed of each: docs/BENCHMARKS.md, \"FP8 fidelity and speed\"")
    fp8_matrices: str = _opt("all", "matrices fp8 converts in those layers: all, or some of mlp, attention "
                                    "(full-attention projections), linear (linear-attention projections)")
    fused_kernels: bool = _opt(True, "the fast path's own Triton kernels (convolution, SwiGLU and norm + "
                                     "FP8)")
    epilogues: str = _opt(DEFAULT_EPILOGUES, "kernels with the fused ones, bf16 (fast path): some of swiglu "
                          "(in the gate/up GEMM), residual (in the GEMMs before it), gated_norm; all; or "
                          "none. Off by default: they moved answers past the bf16 floor (docs/BENCHMARKS.md, \"The gate\")")
    compile_cache: str = _opt("", "directory for compiled kernels (Inductor, Triton, TileLang); empty: their "
                                  "defaults")
    planner_threads: int = _opt(2, "threads that validate, render and tokenize requests", low=1)
    planner_processes: int = _opt(0, "plan in this many processes instead of threads (keeps the GIL for the "
                                     "GPU); with --gpus, 0: sized to the host's cores", low=0)
    # Queue
    redis_url: str = _opt("redis://127.0.0.1:6379/0",
                          "Redis URL (rediss:// for TLS; redis://user:password@host for an ACL user; "
                          "redis+sentinel://host:port,host:port/SERVICE[/db] through Sentinel)",
                          more="rediss+sentinel:// with TLS; through Sentinel a failover is followed without "
                               "a restart (docs/OPERATIONS.md)")
    redis_cluster: bool = _opt(False, "the URL is a node of a Redis Cluster (the client follows slot moves)")
    redis_tls_ca: str = _opt("", "CA certificate file that verifies the Redis server (rediss://)")
    redis_tls_cert: str = _opt("", "client certificate file, when Redis requires client certificates "
                                   "(rediss://)")
    redis_tls_key: str = _opt("", "the client certificate's private key file (rediss://)")
    sentinel_username: str = _opt("", "the sentinels' user, when they require one (the URL's user is the "
                                      "data nodes')")
    sentinel_password: str = _opt("", "the sentinels' password, when they require one (prefer the variable: "
                                      "a flag shows in the process list)")
    wait_replicas: int = _opt(0, "durable mode: a publication and its acknowledgement count once this many "
                                 "replicas have them (WAIT; 0: off)", low=0, high=MAX_WAIT_REPLICAS,
                            more="producers take the same flag (Client(wait_replicas=N)); "
                                 "docs/RELIABILITY.md, \"Failover\"")
    namespace: str = _opt("dq", "prefix of every Redis name of this deployment")
    shard: int = _opt(0, "stream shard this worker reads", low=0)
    consumer: str = _opt("", "consumer name in the group (default: host-pid)")
    block_ms: int = _opt(1000, "blocking read timeout; kept below the socket timeout", low=1,
                        high=SOCKET_TIMEOUT * 1000 - 1000)
    read_count: int = _opt(64, "entries fetched per read (fewer where --max-read-bytes says)", low=1)
    max_read_bytes: int = _opt(64 << 20, "one read or claim asks for at most this many bytes of entries: "
                                         "max(1, this / --max-entry-bytes) entries", low=1,
                               more="after an entry over --max-entry-bytes, one at a time until a read "
                                    "brings none")
    max_inflight: int = _opt(512, "entries of each lane held at once (read, planned, queued or computing); "
                                  "reading that lane pauses above", low=1)
    claim_idle_ms: int = _opt(60000, "reclaim entries pending longer than this from dead consumers", low=1)
    consumer_gone_ms: int = _opt(300000, "delete a group consumer that has nothing pending and has been idle "
                                         "longer than this (its worker is gone)", low=1000)
    max_deliveries: int = _opt(5, "dead-letter an entry delivered more often than this", low=1)
    result_ttl_s: int = _opt(86400, "how long results stay readable", low=1)
    record_ttl_s: int = _opt(0, "how long a request's record (its status, cancel's answer) stays once its "
                                "result is published; 0: as long as the result (--result-ttl-s), never longer",
                             low=0)
    reply_maxlen: int = _opt(10000, "a reply stream keeps about this many newest replies (approximate "
                                    "MAXLEN)",
                             low=100)
    dead_maxlen: int = _opt(100000, "the dead-letter stream keeps about this many newest entries", low=100)
    max_entry_bytes: int = _opt(8 << 20, "an entry whose body is larger (all fields counted, with 1 KiB to "
                                         "spare for the other fields) is refused with too_large, unparsed", low=1,
                                more="a body at the producers' own limit passes")
    max_image_pixels: int = _opt(4096 * 4096, "a request whose images have more pixels in all is refused "
                                              "(decompression bombs)", low=1)
    drain_timeout_s: float = _opt(60.0, "on SIGTERM, longest wait for in-flight work before exiting", low=0)
    stall_timeout_s: float = _opt(60.0, "unready while entries are held and none has been settled for this "
                                        "long, or while one entry has been held for ten times as long", low=1)
    # Operations
    metrics_port: int = _opt(0, "serve /metrics, /healthz and /readyz on this port (0: off)", low=0, high=65535)
    metrics_host: str = _opt("", "address those endpoints bind: an IPv4 or IPv6 address or a name (empty: "
                                 "every interface, IPv6 and IPv4)")
    log_format: str = _opt("text", "text or json", choices=("text", "json"))
    log_level: str = _opt("INFO", "DEBUG, INFO, WARNING or ERROR", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if meta["choices"]:
                canonical = {c.lower(): c for c in meta["choices"]}.get(str(value).lower())
                if canonical is None:
                    problems.append((f.name, f"one of {', '.join(meta['choices'])}", value))
                else:  # frozen: set through object, once, to the spelling the code compares with
                    object.__setattr__(self, f.name, canonical)
            elif meta["low"] is not None and value < meta["low"]:
                problems.append((f.name, f"at least {meta['low']:g}", value))
            elif meta["high"] is not None and value > meta["high"]:
                problems.append((f.name, f"at most {meta['high']:g}", value))
        for name, (parse, allowed) in CHECKED.items():  # the fast path's words (worker/fast_options.py)
            try:
                parse(getattr(self, name))
            except ValueError:
                problems.append((name, allowed, getattr(self, name)))
        if not DEVICE.fullmatch(self.device):
            problems.append(("device", "auto, cpu, cuda or cuda:N", self.device))
        gpus = self.gpus.replace(" ", "")
        if not GPUS.fullmatch(gpus) or len(set(gpus.split(","))) < len(gpus.split(",")):
            problems.append(("gpus", "all, cpu:N (N up to 999) or distinct GPU numbers like 0,1,3", self.gpus))
        elif gpus and self.device != "auto":
            problems.append(("device", "auto with --gpus (the launcher gives each worker its device)", self.device))
        if self.record_ttl_s > self.result_ttl_s:  # a record says what its result says: never kept past it
            problems.append(("record_ttl_s", f"at most --result-ttl-s ({self.result_ttl_s})",
                             self.record_ttl_s))
        names = self.served_model_name.split(",") if self.served_model_name else []
        if not all(MODEL_NAME.match(n) for n in names) or len(set(names)) < len(names):
            problems.append(("served_model_name", "distinct names of 1 to 128 of A-Z a-z 0-9 . _ : / @ + - "
                             "(a letter or digit first)", self.served_model_name))
        if not NAMESPACE.fullmatch(self.namespace):
            problems.append(("namespace", "1 to 64 of A-Z a-z 0-9 . _ -", self.namespace))
        if not self.redis_url.startswith(REDIS_SCHEMES):
            problems.append(("redis_url", "a " + ", ".join(REDIS_SCHEMES) + " URL",  # never echo a password
                             self.redis_url.split(":", 1)[0] + ":..."))
        elif problem := url_problem(self.redis_url):
            problems.append(("redis_url", f"a usable Redis URL: {problem}", "<not shown: it may hold a password>"))
        elif problem := mode_problem(self.redis_url, self.redis_cluster, self.wait_replicas):
            problems.append(("redis_url", problem, "<not shown: it may hold a password>"))
        tls = [name for name in ("redis_tls_ca", "redis_tls_cert", "redis_tls_key") if getattr(self, name)]
        if tls and not tls_url(self.redis_url):  # refused here, before torch loads
            problems.append((tls[0], "empty unless the Redis URL is rediss:// or rediss+sentinel:// (TLS)",
                             "a file, with a plain URL"))
        if (self.sentinel_username or self.sentinel_password) and not is_sentinel(self.redis_url):
            problems.append(("sentinel_username" if self.sentinel_username else "sentinel_password",
                             "empty unless the Redis URL is redis+sentinel:// or rediss+sentinel://", "<not shown>"))
        try:
            if not self.listed_buckets or min(self.listed_buckets) < 1:
                raise ValueError
        except ValueError:
            problems.append(("buckets", "comma-separated token counts of at least 1", self.buckets))
        if problems:
            raise SettingsError("; ".join(f"{_names(name)} must be {need}, got {value!r}"
                                          for name, need, value in problems))

    @property
    def record_ttl(self) -> int:
        """Seconds a record stays once its request is answered: ``--record-ttl-s``, else the result's TTL."""
        return self.record_ttl_s or self.result_ttl_s

    @property
    def consumer_name(self) -> str:
        return self.consumer or f"{socket.gethostname()}-{os.getpid()}"

    @property
    def served_names(self) -> tuple[str, ...]:
        """--served-model-name's names, the one results say first; empty: the checkpoint's own name serves."""
        return tuple(self.served_model_name.split(",")) if self.served_model_name else ()

    @property
    def redis_where(self) -> str:  # the Redis URL without its password, for logs and errors
        return redact(self.redis_url)

    @property
    def listed_buckets(self) -> tuple[int, ...]:
        """--buckets as given."""
        return tuple(sorted(int(b) for b in self.buckets.split(",") if b.strip()))

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """The static pack sizes captured as CUDA graphs: --pack-tokens (every pack's budget, graphs or not)
        and the listed sizes below it (larger ones would hold no pack)."""
        return tuple(sorted({size for size in self.listed_buckets if size < self.pack_tokens} | {self.pack_tokens}))

    def redis_options(self) -> dict[str, Any]:
        """Connection options beyond the URL: the TLS files (a rediss:// URL: checked above), the
        sentinels'."""
        files = {"ssl_ca_certs": self.redis_tls_ca, "ssl_certfile": self.redis_tls_cert,
                 "ssl_keyfile": self.redis_tls_key}
        return {**{name: path for name, path in files.items() if path},
                **credentials(self.sentinel_username, self.sentinel_password)}

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def env_name(name: str) -> str:
        return "DQ_" + name.upper()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(cls.env_name(f.name))
            if raw is not None:
                values[f.name] = _convert(f.type, raw, f.name)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, in sections, choices shown; defaults stay None so that the environment is not
        shadowed."""
        group: Any = parser
        for f in fields(cls):
            if f.name in SECTIONS:
                group = parser.add_argument_group(SECTIONS[f.name])
            flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ())]
            help_text = f"{f.metadata['help']} [env {cls.env_name(f.name)}, default {shown_default(f)}]"
            if f.type in BOOLEANS:
                group.add_argument(*flags, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                                   help=help_text)
            elif f.name in REPEATED:
                group.add_argument(*flags, dest=f.name, default=None, action="append", help=help_text)
            else:
                # choices are matched ignoring case when the settings are made: shown here, not enforced
                shown = {"metavar": "{" + ",".join(f.metadata["choices"]) + "}"} if f.metadata["choices"] else {}
                group.add_argument(*flags, dest=f.name, default=None, type=_parser(f.type), help=help_text,
                                   **shown)

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
        given = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        for name in REPEATED:
            given[name] = ",".join(given[name]) if given[name] else None
        return cls.from_env(environ, **given)


def shown_default(f: dataclasses.Field) -> str:
    """A field's default as the help and docs/CONFIGURATION.md show it (a switch left unset: auto)."""
    return "auto" if f.default is None and f.type == OPTIONAL_SWITCH else repr(f.default)


def _names(name: str) -> str:
    return f"--{name.replace('_', '-')} ({Settings.env_name(name)})"


def _parser(type_name: str) -> Any:
    return {"int": int, "float": float}.get(type_name, str)


def _convert(type_name: str, raw: str, name: str) -> Any:
    if type_name in BOOLEANS:
        lowered = raw.strip().lower()
        if type_name == OPTIONAL_SWITCH and lowered in ("", "auto"):
            return None
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{Settings.env_name(name)}={raw!r} is not a boolean"
                         + (" (or auto)" if type_name == OPTIONAL_SWITCH else ""))
    try:
        return _parser(type_name)(raw)
    except ValueError:
        raise ValueError(f"{Settings.env_name(name)}={raw!r} is not a valid {type_name}") from None
