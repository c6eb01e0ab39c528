"""The gateway's one settings object: the producer's connection settings (``Deployment``: ``--redis-url``,
``DQ_REDIS_URL``, ...) plus the gateway's own, each a flag (``--max-batch``) and a variable
(``DQ_GATEWAY_MAX_BATCH``); flags win over the environment, the environment over the defaults. Checked when
made: a bad value is a ConfigError naming the flag and the variable, and ``dq-gateway`` exits 2 before it
listens.

API keys come from a JSON file (``--api-keys-file``) or from ``DQ_GATEWAY_API_KEYS`` (the same JSON): a list
of ``{"name", "token", "namespace", "lanes", "max_inflight", "hang_up"}``. Without keys the gateway is open to
whoever reaches it, so it then listens on a loopback address only.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..client.plans import BATCH
from ..plumbing.connection import Deployment
from ..wire.keys import LANES, MAX_BODY_BYTES, MODEL_NAME, NAMESPACE_PATTERN, Priority
from ..wire.schema import describe

KEYS_VARIABLE = "DQ_GATEWAY_API_KEYS"
# A guessable token is no key; 32 random URL-safe bytes (secrets.token_urlsafe) is the advice.
MIN_TOKEN_CHARS = 16


class ConfigError(ValueError):
    """A setting out of range, or unusable API keys: named by flag and variable, never quoting a token."""


class ApiKey(BaseModel):
    """One key of the keys file. ``namespace``: the deployment whose queue it uses (default the gateway's); a
    tenant is a namespace, so keys of one namespace share its results. ``lanes``: the priorities it may
    send."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    token: str = Field(min_length=MIN_TOKEN_CHARS, max_length=512, repr=False)
    namespace: str | None = None
    lanes: tuple[Literal["high", "normal"], ...] = Field(default=tuple(str(lane) for lane in LANES),
                                                         min_length=1)
    max_inflight: int | None = Field(default=None, ge=1)
    hang_up: Literal["cancel", "keep"] = "cancel"  # a caller that hangs up cancels what it waited for, or not
    # The namespaces whose models it may name (POST /v1/systemone, GET /v1/models), in the order they are
    # looked in; default: its namespace (or the gateway's --model-namespaces for a key that names no
    # namespace).
    model_namespaces: tuple[str, ...] | None = Field(default=None, min_length=1)

    @field_validator("token")
    @classmethod
    def _token_characters(cls, value: str) -> str:
        # What a bearer header carries: printable ASCII, no space.
        if not all("!" <= ch <= "~" for ch in value):
            raise ValueError("a token is printable ASCII without spaces")
        return value

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and not NAMESPACE_PATTERN.match(value):
            raise ValueError("a namespace is 1 to 64 of A-Z a-z 0-9 . _ -")
        return value

    @field_validator("model_namespaces")
    @classmethod
    def _model_namespaces(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for namespace in value or ():
            cls._namespace(namespace)
        return value

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(self.token.encode()).digest()

    def lane_set(self) -> frozenset[Priority]:
        return frozenset(Priority(lane) for lane in self.lanes)


def _opt(default: Any, help: str, low: float | None = None, high: float | None = None,
         repeat: bool = False) -> Any:
    return field(default=default, metadata={"help": help, "low": low, "high": high, "repeat": repeat})


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's settings, each a flag and a ``DQ_GATEWAY_*`` variable, checked when made (``load``)."""

    deployment: Deployment = field(default_factory=Deployment, metadata={"help": ""})
    host: str = _opt("127.0.0.1", "address to listen on (without API keys, a loopback address only)")
    port: int = _opt(8080, "port to listen on", low=1, high=65535)
    api_keys_file: str = _opt(
        "", f"JSON file of API keys (or their JSON in {KEYS_VARIABLE}); none: open, loopback only")
    max_body_bytes: int = _opt(MAX_BODY_BYTES, "largest request body; larger ones are refused with 413",
                               low=1)
    max_batch: int = _opt(BATCH, f"most requests in one call (at most {BATCH}, the client's batch); more: "
                                 "413", low=1, high=BATCH)
    max_inflight_per_key: int = _opt(
        256, "requests of one API key being answered at once (a key may say less or more); beyond: 429",
        low=1)
    wait_s: float = _opt(
        30.0, "how long /v1/decide waits for a result unless the call says (?timeout=); then 504", low=0.001)
    max_wait_s: float = _opt(300.0, "the longest wait a call may ask for", low=0.001)
    max_unfinished: int = _opt(
        100_000, "backpressure: entries a lane's stream may hold before 429 (0: no limit)", low=0)
    # Hostile and careless callers (docs/RELIABILITY.md, "Hostile callers"): connections.py, admission.py
    max_connections: int = _opt(
        1024, "HTTP connections open at once; one more closes the longest-idle keep-alive one, or is "
              "answered 503 (kept under the process's file limit)", low=1)
    max_header_bytes: int = _opt(
        16384, "a request's head (request line and headers) at most; more: 431, closed", low=1024)
    header_timeout_s: float = _opt(
        10.0, "a request's head complete within this of the connection's start (or its first byte); else "
              "408, closed", low=0.1)
    body_timeout_s: float = _opt(30.0, "the longest pause between parts of a body; then 408, closed", low=0.1)
    keep_alive_s: float = _opt(
        65.0, "an idle connection between requests is closed after this (above clients' pools: the SDK keeps "
              "30 s, load balancers 60 s)", low=1.0)
    max_body_bytes_in_flight: int = _opt(
        64 << 20, "bodies held at once, over every caller, while their calls run (a call without a length "
                  "counts --max-body-bytes, a compressed one what it inflates to); beyond: 503 busy", low=1)
    model_namespaces: str = _opt(
        "", "the namespaces whose models callers may name (POST /v1/systemone), in order, comma-separated, "
            "for keys that name no namespace and without keys; empty: --namespace")
    model_alias: str = _opt(
        "", "ALIAS=NAME: a model name callers may send for a served one (e.g. the official clients' default "
            "jev-latest); repeat the flag, or separate by commas. Never a served name: refused at start, and "
            "not routed by once a worker serves it", repeat=True)
    retry_window_s: float = _opt(
        0.0, "how long a System One call's retries map to its request (and identical calls are computed "
             "once); 0: the clients' 30 s retry budget plus --wait-s", low=0)
    log_level: str = _opt("INFO", "DEBUG, INFO, WARNING or ERROR")
    log_format: str = _opt(
        "text", "text, or json: one JSON object per line, the gateway's lines and uvicorn's alike")
    access_log: str = _opt(
        "on", "on: one line per call (method, path, status, duration, key, lane, client; probes and scrapes "
              "at DEBUG); off: none")
    cors_allow_origin: str = _opt(
        "", "origins browsers may call from, comma-separated (https://app.example), or * for any; empty: no "
            "CORS headers")
    keys: tuple[ApiKey, ...] = field(default=(), metadata={"help": ""})  # read from the file or the variable

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            low, high, value = f.metadata.get("low"), f.metadata.get("high"), getattr(self, f.name)
            # nan passes every comparison, inf any low
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{_names(f.name)} must be a finite number, got {value!r}")
            elif low is not None and value < low:
                problems.append(f"{_names(f.name)} must be at least {low:g}, got {value!r}")
            elif high is not None and value > high:
                problems.append(f"{_names(f.name)} must be at most {high:g}, got {value!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            problems.append(f"{_names('log_level')} must be DEBUG, INFO, WARNING or ERROR, got "
                            f"{self.log_level!r}")
        for name, allowed in (("log_format", ("text", "json")), ("access_log", ("on", "off"))):
            if getattr(self, name) not in allowed:
                problems.append(f"{_names(name)} must be {' or '.join(allowed)}, got {getattr(self, name)!r}")
        for origin in filter(None, (o.strip() for o in self.cors_allow_origin.split(","))):
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                problems.append(f"{_names('cors_allow_origin')}: an origin is scheme://host[:port] (or *), got "
                                f"{origin!r}")
        if not NAMESPACE_PATTERN.match(self.deployment.namespace):
            problems.append(f"--namespace (DQ_NAMESPACE) must be 1 to 64 of A-Z a-z 0-9 . _ -, got "
                            f"{self.deployment.namespace!r}")
        if self.wait_s > self.max_wait_s:
            problems.append(f"{_names('wait_s')} must be at most {_names('max_wait_s')}")
        if self.max_body_bytes_in_flight < self.max_body_bytes:  # else a body of the largest size never fits
            problems.append(f"{_names('max_body_bytes_in_flight')} must be at least "
                            f"{_names('max_body_bytes')}")
        if not self.keys and not loopback(self.host):
            problems.append(f"without API keys the gateway listens on a loopback address only, not {self.host!r}: "
                            f"give --api-keys-file (or {KEYS_VARIABLE}), or --host 127.0.0.1")
        for namespace in self.model_namespace_list:
            if not NAMESPACE_PATTERN.match(namespace):
                problems.append(f"{_names('model_namespaces')} must list namespaces of 1 to 64 of A-Z a-z 0-9 . _ -, "
                                f"got {namespace!r}")
        try:
            self.aliases
        except ValueError as error:
            problems.append(f"{_names('model_alias')}: {error}")
        names, digests = [k.name for k in self.keys], {k.digest for k in self.keys}
        if len(set(names)) < len(names) or len(digests) < len(self.keys):
            problems.append("API keys must have distinct names and distinct tokens")
        if problems:
            raise ConfigError("; ".join(problems))

    def namespace_of(self, key: ApiKey | None) -> str:
        return (key.namespace if key is not None else None) or self.deployment.namespace

    @property
    def model_namespace_list(self) -> tuple[str, ...]:
        listed = tuple(n.strip() for n in self.model_namespaces.split(",") if n.strip())
        return listed or (self.deployment.namespace,)

    def model_namespaces_of(self, key: ApiKey | None) -> tuple[str, ...]:
        """Where a caller's model names are looked for: its key's list, else its namespace (the gateway's list
        for a key that names none, and without keys)."""
        if key is not None and key.model_namespaces:
            return key.model_namespaces
        return (key.namespace,) if key is not None and key.namespace else self.model_namespace_list

    @property
    def aliases(self) -> dict[str, str]:
        """--model-alias as {alias: name}; a ValueError for a pair that is not ALIAS=NAME of model names, or an
        alias that is the model of a pair (``a=a``; ``b=a,a=c``)."""
        out: dict[str, str] = {}
        for pair in filter(None, (p.strip() for p in self.model_alias.split(","))):
            alias, _, name = pair.partition("=")
            if not (MODEL_NAME.match(alias.strip()) and MODEL_NAME.match(name.strip())) or alias.strip() in out:
                raise ValueError(f"expected distinct ALIAS=NAME pairs of model names, got {pair!r}")
            out[alias.strip()] = name.strip()
        # A served name never is an alias: the names aliased (served, or the call is 404) are known here; the
        # other served names are checked at start (dq-gateway reads the heartbeats) and while routing.
        if shadowing := sorted(set(out) & set(out.values())):
            raise ValueError(f"{', '.join(shadowing)}: an alias that names a served model (the model of an ALIAS=NAME "
                             "pair) would take its calls")
        return out

    def namespaces(self) -> list[str]:
        """Every namespace a caller can reach, its own and those of the models it may name."""
        reached = {self.namespace_of(k) for k in self.keys}
        reached |= {n for k in self.keys for n in self.model_namespaces_of(k)}
        return sorted(reached or {self.deployment.namespace, *self.model_namespace_list})


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _names(name: str) -> str:
    return f"--{name.replace('_', '-')} ({env_name(name)})"


def env_name(name: str) -> str:
    return "DQ_GATEWAY_" + name.upper()


def own_fields() -> list[Any]:
    return [f for f in fields(GatewayConfig) if f.name not in ("deployment", "keys")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags; defaults stay None so that the environment is not shadowed."""
    for f in own_fields():
        kind = {"int": int, "float": float}.get(f.type, str)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None, type=kind,
                            action="append" if f.metadata["repeat"] else "store",
                            help=f"{f.metadata['help']} [env {env_name(f.name)}, default {f.default!r}]")


def parse_keys(text: str, where: str) -> tuple[ApiKey, ...]:
    """API keys from their JSON text; a ConfigError says what is wrong, never which token."""
    try:
        raw = json.loads(text)
    except ValueError as error:
        raise ConfigError(f"{where} is not JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(raw, list):
        raise ConfigError(f"{where} must be a JSON list of keys ({{\"name\", \"token\", ...}})")
    keys = []
    for index, item in enumerate(raw):
        try:
            keys.append(ApiKey.model_validate(item))
        except ValidationError as error:
            raise ConfigError(f"{where}, key {index}: {describe(error)}") from None
    return tuple(keys)


def load(values: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """The settings from flag values (None: not given), then the environment, then the defaults."""
    environ = os.environ if environ is None else environ
    deployment = Deployment.resolve(environ, **{k: values.get(k) for k in Deployment.ENV})
    chosen: dict[str, Any] = {}
    for f in own_fields():
        value, raw = values.get(f.name), environ.get(env_name(f.name))
        if isinstance(value, list):  # a repeated flag
            value = ",".join(value)
        if value is None and raw is not None:
            try:
                value = {"int": int, "float": float}.get(f.type, str)(raw)
            except ValueError:
                raise ConfigError(f"{env_name(f.name)}={raw!r} is not a number") from None
        if value is not None:
            chosen[f.name] = value
    path, inline = chosen.get("api_keys_file", ""), environ.get(KEYS_VARIABLE)
    keys: tuple[ApiKey, ...] = ()
    if path and inline:
        raise ConfigError(f"API keys come from --api-keys-file or {KEYS_VARIABLE}, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                keys = parse_keys(handle.read(), f"the API keys file {path}")
        except OSError as error:
            raise ConfigError(f"the API keys file cannot be read: {error.strerror}: {path}") from None
    elif inline:
        keys = parse_keys(inline, KEYS_VARIABLE)
    if (path or inline) and not keys:  # a keys file that lists none must not quietly open the gateway
        raise ConfigError(f"{path or KEYS_VARIABLE} lists no API keys")
    return GatewayConfig(deployment=deployment, keys=keys, **chosen)
