"""How one sweep job's simulation uses the machine: the ``sim.*`` settings (engine, nodes, resources, cluster).

They are not run-config keys: they choose how a run is simulated, never what it computes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from alignfl.fl_app.config import ConfigError
from alignfl.fl_app.engines.batched import workers_allowed
from alignfl.fl_app.engines.grid import VECTORISE_CHOICES
from alignfl.fl_app.runtime.ray_cluster import attach_to_cluster
from alignfl.plugins.options import non_negative, option, positive

STRING_SETTINGS = ("backend", "ray_address", "vectorise")


def _none_or(check: Any) -> Any:
    return lambda value: value is None or check(value)


def _whole(check: Any) -> Any:
    return lambda value: check(value) and float(value).is_integer()


@dataclass(frozen=True)
class SimSettings:
    """How one job's simulation uses the machine (``sim.*``; not run-config keys)."""

    backend: str = option(
        "batched",
        "batched (the default: no Ray to start per job, and the same metrics rows as ray for every algorithm): "
        "a round's messages at once to long-lived workers (the job's process, or Ray actors: sim.workers, "
        "sim.ray_address); ray: Flower's simulation runtime, clients in parallel on Ray (flwr run on a private "
        "local SuperLink); inprocess: the same apps in the job's process, one client at a time",
        lambda v: v in ("ray", "inprocess", "batched"),
        "choose one of ['batched', 'inprocess', 'ray']",
    )
    vectorise: str = option(
        "auto",
        "batched engine: on trains a round's clients as one stacked update where the algorithm and the model "
        "allow it; auto does so only where the clients also train on CUDA (on a CPU stacking was not faster); "
        "off: one after another (the log says which and why)",
        lambda v: v in VECTORISE_CHOICES,
        f"choose one of {list(VECTORISE_CHOICES)}",
    )
    workers: int | None = option(
        None,
        "batched engine: this many Ray actors as workers (client_cpus, client_gpus each); null: one "
        "worker in the job's process, or with sim.ray_address as many as the cluster holds",
        workers_allowed,
        "must be a positive integer or null",
    )
    num_supernodes: int = option(
        10,
        "clients; the job also sets run-config min-available-nodes to this",
        lambda v: isinstance(v, int) and v > 0,
        "must be a positive integer",
    )
    client_cpus: float = option(
        1,
        "Ray CPUs per client (ray) or per Ray actor worker (batched with sim.workers or sim.ray_address): at most "
        "ray_cpus / client_cpus of them train at once",
        _whole(positive),
        "must be a positive whole number (Flower's simulation config takes whole CPUs per client)",
    )
    client_gpus: float = option(
        0.0,
        "Ray GPUs per client (ray) or per Ray actor worker (batched with sim.workers or sim.ray_address), e.g. 0.25: "
        "four share one GPU; batched without Ray actors trains on the job's own device (device=auto)",
        non_negative,
        "must be a non-negative number",
    )
    ray_cpus: int | None = option(
        None,
        "CPUs this job's Ray may use (null: every core); cap it when jobs run in parallel",
        _none_or(lambda v: isinstance(v, int) and v > 0),
        "must be a positive integer or null",
    )
    ray_gpus: float | None = option(
        None,
        "GPUs this job's Ray may use (null: every visible GPU)",
        _none_or(_whole(non_negative)),
        "must be a non-negative whole number or null (Flower's simulation config takes whole GPUs)",
    )
    ray_address: str | None = option(
        None,
        "a running Ray cluster the job's clients run on (HOST:PORT of its head, "
        "or auto); its nodes' resources decide where; null: a Ray of the job's own",
        _none_or(lambda v: isinstance(v, str) and v != ""),
        "must be a non-empty string (HOST:PORT or auto) or null",
    )
    torch_threads: int | None = option(
        None,
        "torch threads of the job's own process (server-side evaluation); null: torch's default",
        _none_or(lambda v: isinstance(v, int) and v > 0),
        "must be a positive integer or null",
    )

    @classmethod
    def from_config(cls, sim: Mapping[str, Any]) -> SimSettings:
        """Check ``sim.*`` the way the schema checks run-config keys: name the key, the value, what is allowed."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(sim) - known)
        if unknown:
            raise ConfigError(
                f"sim has key(s) {['sim.' + k for k in unknown]} it does not know; "
                f"the keys are {sorted('sim.' + k for k in known)}"
            )
        settings = cls(**sim)
        for name, spec in cls.__dataclass_fields__.items():
            value = getattr(settings, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float, str, type(None)))
                or (isinstance(value, str) and name not in STRING_SETTINGS)
                or not spec.metadata["check"](value)
            ):
                raise ConfigError(f"'sim.{name}' = {value!r} is not allowed: {spec.metadata['allowed']}")
        if settings.ray_cpus is not None and settings.client_cpus > settings.ray_cpus:
            raise ConfigError(
                f"sim.client_cpus = {settings.client_cpus} is not allowed: must be at most "
                f"sim.ray_cpus = {settings.ray_cpus}, or no client could ever be scheduled"
            )
        if settings.workers is not None and settings.backend != "batched":
            raise ConfigError(f"sim.workers = {settings.workers} needs sim.backend=batched, got {settings.backend!r}")
        if settings.ray_address is not None:
            if settings.backend not in ("ray", "batched"):
                raise ConfigError(
                    f"sim.ray_address = {settings.ray_address!r} needs sim.backend=ray or batched, "
                    f"got {settings.backend!r}"
                )
            given = [f"sim.{name}" for name in ("ray_cpus", "ray_gpus") if getattr(settings, name) is not None]
            if given:
                raise ConfigError(
                    f"{given} must be null with sim.ray_address: Ray refuses resource counts when it "
                    "joins a running cluster, whose nodes declared theirs when they were started"
                )
        return settings

    def attach(self) -> SimSettings:
        """With ``ray_address``: the cluster checked (it answers, a client fits on a node) and its address
        resolved; else itself."""
        if self.ray_address is None:
            return self
        resolved = attach_to_cluster(self.ray_address, "sim.ray_address", self.client_cpus, self.client_gpus)
        return dataclasses.replace(self, ray_address=resolved)

    def federation_config(self) -> dict[str, Any]:
        """Flower's simulation config (``flwr run --federation-config``): the nodes, resources per client, and a
        cap on this job's own Ray (a running cluster, ``ray_address``, is joined through ``RAY_ADDRESS``)."""
        caps = {"init-args-num-cpus": self.ray_cpus, "init-args-num-gpus": self.ray_gpus}
        return {
            "num-supernodes": self.num_supernodes,
            "client-resources-num-cpus": int(self.client_cpus),
            "client-resources-num-gpus": float(self.client_gpus),
            **{key: int(value) for key, value in caps.items() if value is not None},
        }
