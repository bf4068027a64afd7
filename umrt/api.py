"""Switching umrt on in code: :func:`enable`, :func:`session`, :func:`disable`.

    import umrt
    umrt.enable(gpu_memory="20%")          # before the first CUDA tensor
    ...train...

    with umrt.session(policy="um-advise"):  # or scoped
        ...

:func:`enable` reads the ``UMRT_*`` variables (:mod:`umrt.config`), applies
keyword overrides, and on a CUDA machine builds the managed-memory backend,
umrt's pool, routes torch's (and CuPy's) allocations into it and starts the
runtime policy. Without a GPU it says so once and returns an inactive
:class:`Session`: the program runs unchanged.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from umrt import stats
from umrt.config import Config, from_env
from umrt.errors import ConfigError, CudaError

log = logging.getLogger("umrt")

_lock = threading.Lock()
_current: Session | None = None
_said_no_gpu = False


@dataclass
class Session:
    """An enabled umrt: what it runs on and with which settings.

    ``active`` is False when there is no GPU (the program runs unchanged).
    """

    config: Config
    active: bool = False
    backend: Any = None  # umrt.backends.cuda.CudaBackend
    pool: Any = None  # umrt.allocators.managed.ManagedPool
    budget_bytes: int = 0
    runtime: Any = None  # what umrt.runtime.attach(session) returned, if anything
    telemetry: Any = None  # umrt.telemetry.Sampler
    notes: list[str] = field(default_factory=list)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        disable()


def gpu_count() -> int:
    """CUDA devices this process can use (0 without a driver, runtime or device)."""
    try:
        from umrt.backends.cuda import default_api

        return default_api().device_count()
    except (CudaError, ImportError):
        return 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        return 0


def say_no_gpu_once(what: str = "running unchanged") -> None:
    """The one-line note printed when umrt is asked for but there is no GPU."""
    global _said_no_gpu
    if not _said_no_gpu:
        print(f"umrt: no CUDA GPU found; {what}", file=sys.stderr)
        _said_no_gpu = True


def enable(config: Config | None = None, **overrides: Any) -> Session:
    """Switch umrt on for this process and return the :class:`Session`.

    Args:
        config: a :class:`~umrt.config.Config`; default :func:`umrt.config.from_env`.
        **overrides: any ``Config`` field, e.g. ``gpu_memory="20%"``, ``policy="um"``,
            ``device=1``, ``telemetry=True``.

    Raises:
        ConfigError: a bad setting, or shadow mode requested in code.
        AllocatorError: torch already allocated CUDA memory.
    """
    global _current
    cfg = (config or from_env()).replace(enabled=True, **overrides)
    if cfg.shadow and "simulate" not in overrides:
        # UMRT_SIMULATE from the environment: this process is being simulated (shadow run);
        # a script's own umrt.enable() must not touch a GPU there.
        with _lock:
            if _current is None:
                _current = Session(cfg, active=False, notes=["shadow mode: simulated, not managed"])
            return _current
    if cfg.shadow:
        raise ConfigError(
            f"UMRT_SIMULATE={cfg.simulate!r} asks for shadow mode, which simulates a whole script: "
            f"use `umrt run --simulate {cfg.simulate} script.py` or "
            f"`UMRT=1 UMRT_SIMULATE={cfg.simulate} python script.py`"
        )
    with _lock:
        if _current is not None:
            if _current.config != cfg:
                log.warning("umrt is already enabled; keeping the first settings")
            return _current
        logging.getLogger("umrt").setLevel(cfg.log_level.upper())
        if gpu_count() == 0:
            say_no_gpu_once()
            _current = Session(cfg, active=False, notes=["no CUDA GPU"])
            return _current
        _current = _start(cfg)
        return _current


def _start(cfg: Config) -> Session:
    from umrt.allocators import cupy as cupy_alloc
    from umrt.allocators.managed import ManagedPool
    from umrt.backends.cuda import CudaBackend

    backend = CudaBackend(cfg.device)
    _, total = backend.mem_info()
    budget = cfg.gpu_memory.resolve(total)
    arena = cfg.short_lived_arena.resolve(budget) if cfg.short_lived_arena else None
    pool = ManagedPool(backend, _layout_factory(arena))
    session = Session(cfg, active=True, backend=backend, pool=pool, budget_bytes=budget)
    stats.attach(pool=pool, backend=backend)
    cupy_alloc.set_pool(pool)
    _install_torch(session)
    session.runtime = _attach_runtime(session)
    if cfg.telemetry:
        from umrt.telemetry import Sampler

        session.telemetry = Sampler(cfg.device, pci_bus_id=_pci_bus_id(cfg.device)).start()
        atexit.register(session.telemetry.stop_and_report)
    return session


def _pci_bus_id(device: int) -> str | None:
    """The CUDA device's PCI bus id, so NVML samples the same GPU under CUDA_VISIBLE_DEVICES."""
    try:
        import cupy

        return str(cupy.cuda.runtime.deviceGetPCIBusId(device))
    except Exception:  # noqa: BLE001 - no CuPy: fall back to the index
        return None


def _layout_factory(arena: int | None) -> Any:
    from umrt.allocators.managed import default_layout_factory

    if arena is None:
        return default_layout_factory
    from umrt.memory.pool import LifetimePool

    return lambda backend: LifetimePool(backend, short_lived_bytes=arena)


def _install_torch(session: Session) -> None:
    """Route torch if a CUDA build is importable; a CPU build is a note, not an error."""
    try:
        import torch
    except ImportError:
        return
    if torch.version.cuda is None:
        session.notes.append("torch is a CPU build: only CuPy allocations are managed")
        return
    from umrt.allocators import torch as torch_alloc

    torch_alloc.install(session.pool)
    session.backend.set_compute_stream(torch.cuda.current_stream(session.config.device).cuda_stream)


def _attach_runtime(session: Session) -> Any:
    """Start the policy live: a capture Recorder's events fed to it (:class:`LiveBridge`)."""
    if "torch" not in sys.modules:
        return None
    bridge = LiveBridge(session)
    bridge.start()
    return bridge


class ManagedOnly:
    """A backend view that drops ranges outside umrt's managed allocations.

    Storages torch made before umrt was enabled (or pinned host buffers) show
    up in the live event stream; the driver would reject them, so they are
    skipped here instead of failing the training run.
    """

    def __init__(self, backend: Any) -> None:
        self._b = backend
        self.name, self.device = backend.name, backend.device

    def _keep(self, ranges: Any) -> list:
        out = []
        for ptr, n in ranges:
            alloc = self._b.allocation_of(ptr) if ptr else None
            if alloc is not None and ptr + n <= alloc[0] + alloc[1]:
                out.append((ptr, n))
        return out

    def prefetch(self, ranges: Any, device: int) -> None:
        self._b.prefetch(self._keep(ranges), device)

    def discard(self, ranges: Any) -> None:
        self._b.discard(self._keep(ranges))

    def advise(self, ranges: Any, advice: Any, device: int) -> None:
        self._b.advise(self._keep(ranges), advice, device)

    def launch(self, reads: Any, writes: Any, flops: int = 0, nbytes: int = 0, precision: str = "") -> None:
        self._b.launch(self._keep(reads), self._keep(writes), flops, nbytes, precision)

    def __getattr__(self, name: str) -> Any:  # malloc, free, synchronize, mem_info, counters
        return getattr(self._b, name)


class LiveLayout:
    """The :class:`~umrt.memory.base.Layout` of a live program: torch already placed
    every storage (through umrt's pool); this layout only reports where."""

    def __init__(self, recorder: Any, pool: Any) -> None:
        self.recorder, self.pool = recorder, pool
        self._where: dict[int, int] = {}

    def alloc(self, obj: int, nbytes: int, kind: Any) -> int:
        ptr = self._where[obj] = self.recorder.address(obj)
        return ptr

    def free(self, obj: int) -> None:
        self._where.pop(obj, None)

    def address(self, obj: int) -> int:
        return self._where.get(obj, 0)

    def footprint(self) -> int:
        return self.pool.reserved_bytes()


_KNOWN_GPUS = ("V100", "A100", "H100", "H200", "GH200")


def _profile_for(cfg: Any, backend: Any) -> Any:
    """The hardware profile the runtime plans with: ``UMRT_PROFILE``, else (auto)
    the shipped profile closest to this GPU, as ``umrt calibrate`` starts from;
    None (the runtime's generic guesses) where the GPU cannot be read."""
    from umrt.calibrate import closest_profile_name
    from umrt.hardware import load_profile

    if cfg.profile:
        return load_profile(cfg.profile)
    try:
        import torch

        name = torch.cuda.get_device_name(cfg.device)
        total = backend.mem_info()[1]
    except Exception as exc:  # noqa: BLE001 - no CUDA device to read: plan without a profile
        log.info("umrt: no GPU to pick a hardware profile for (%s); set UMRT_PROFILE", exc)
        return None
    chosen = closest_profile_name(name, total)
    if not any(k in name.upper() for k in _KNOWN_GPUS):
        log.warning("umrt: no shipped hardware profile for %s; planning with %s. Run `umrt calibrate` "
                    "and set UMRT_PROFILE to its file for this GPU's own figures", name, chosen)
    return load_profile(chosen)


class LiveBridge:
    """Feeds a capture :class:`~umrt.capture.Recorder`'s live events to the policy,
    in the order the simulator's replay uses (Alloc: layout then policy; Launch:
    policy then ``backend.launch``; Free: policy then layout)."""

    def __init__(self, session: Session, device: str = "cuda") -> None:
        from umrt.capture import Recorder
        from umrt.policy import make_policy
        from umrt.policy.base import PolicyContext

        cfg = session.config
        options: dict[str, Any] = {}
        if cfg.policy == "umrt":
            options = {"learn_iterations": cfg.learn_iterations, "op_level": cfg.granularity == "op",
                       "use_pool": False}
        self.policy = make_policy(cfg.policy, **options)
        self.recorder = Recorder(listeners=(self.on_event,), device=device, steer=False)
        self.failed: BaseException | None = None
        self.events = 0
        self.backend = ManagedOnly(session.backend)
        self.layout = LiveLayout(self.recorder, session.pool)
        profile = _profile_for(cfg, session.backend)
        self.policy.attach(PolicyContext(self.backend, self.layout, session.budget_bytes, profile))

    def on_event(self, ev: Any) -> None:
        """One live event; a failure stops umrt's actions (with one warning), never the training."""
        if self.failed is not None:
            return
        self.events += 1
        try:
            self._dispatch(ev)
        except Exception as exc:  # noqa: BLE001
            self.failed = exc
            log.warning("umrt: runtime stopped acting after an error (%s: %s); memory stays managed",
                        type(exc).__name__, exc)

    def _dispatch(self, ev: Any) -> None:
        from umrt.trace.events import Alloc, Free, Launch

        if isinstance(ev, Alloc):
            self.layout.alloc(ev.obj, ev.nbytes, ev.kind)
            self.policy.on_event(ev)
        elif isinstance(ev, Launch):
            self.policy.on_event(ev)
            reads: list[tuple[int, int]] = []
            writes: list[tuple[int, int]] = []
            for a in ev.accesses:  # each object's address looked up once
                ptr = self.layout.address(a.obj)
                if ptr:
                    (writes if a.write else reads).append((ptr + a.offset, a.length))
            self.backend.launch(reads, writes, ev.flops, ev.bytes, ev.precision)
        elif isinstance(ev, Free):
            self.policy.on_event(ev)
            self.layout.free(ev.obj)
        else:
            self.policy.on_event(ev)

    def start(self) -> None:
        self.recorder.__enter__()

    def close(self) -> None:
        self.recorder.__exit__(None, None, None)


def current() -> Session | None:
    """The enabled session, or None."""
    return _current


def disable() -> None:
    """Stop the runtime policy and telemetry.

    torch cannot swap its allocator back: tensors already made stay in
    managed memory and new ones keep coming from umrt's pool (without
    prefetching) until the process ends.
    """
    global _current
    with _lock:
        session, _current = _current, None
    if session is None or not session.active:
        return
    close = getattr(session.runtime, "close", None)
    if callable(close):
        close()
    if session.telemetry is not None:
        session.telemetry.stop_and_report()
    session.backend.synchronize()


@contextlib.contextmanager
def session(config: Config | None = None, **overrides: Any) -> Iterator[Session]:
    """``with umrt.session(gpu_memory="20%") as s:`` - :func:`enable` for a block, then :func:`disable`."""
    s = enable(config, **overrides)
    try:
        yield s
    finally:
        disable()
