"""Switching umrt on in code: :func:`enable`, :func:`session`, :func:`disable`.

    import umrt
    umrt.enable(gpu_memory="20%device")    # before the first CUDA tensor
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
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from umrt import distributed, share, stats
from umrt.config import Config, format_bytes, from_env, parse_bool
from umrt.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from umrt.drive.live import LiveBridge

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
    runtime: LiveBridge | None = None  # the live source of events, where torch is in use
    steady: Any = None  # umrt.native.server.SteadyServer: the allocator torch and CuPy call
    telemetry: Any = None  # umrt.telemetry.Sampler
    share: share.Share | None = None  # this job's share of the GPU (None: UMRT_SHARE_DIR=off)
    notes: list[str] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)  # torch hook handles removed at disable

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        _disable_keeping(exc_type is not None)


def gpu_count() -> int:
    """CUDA devices this process can use (0 without a driver, runtime or device)."""
    # optional: the CUDA backend needs numpy; `import umrt` must stay light
    from umrt.backends import cuda

    return cuda.gpu_count()


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
        **overrides: any ``Config`` field, e.g. ``gpu_memory="20%device"``, ``policy="um"``,
            ``device=1``, ``telemetry=True``.

    Raises:
        ConfigError: a bad setting, or shadow mode requested in code.
        AllocatorError: torch already allocated CUDA memory.
    """
    global _current
    cfg = (config or from_env()).replace(enabled=True, **overrides)
    cfg.budget()  # a budget this run cannot read fails here, before anything starts
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
        count = gpu_count()
        if count == 0:
            say_no_gpu_once()
            _current = Session(cfg, active=False, notes=["no CUDA GPU"])
            return _current
        for note in cfg.notes():  # an old spelling: what it means now, once
            print(f"umrt: note: {note}", file=sys.stderr)
        rank = distributed.rank_info()
        explicit = "device" in overrides or "UMRT_DEVICE" in os.environ or cfg.device != 0
        cfg = cfg.replace(device=distributed.rank_device(cfg.device if explicit else None, rank, count))
        distributed.check_same_settings(cfg, rank)
        _refuse_nccl_register_hook()
        _current = _start(cfg)
        return _current


def _refuse_nccl_register_hook() -> None:
    """``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1`` asks torch to register its caching
    allocator's segments with NCCL. umrt replaces that allocator with a pluggable one, which
    refuses the hook ("CUDAPluggableAllocator does not support attachAllocatorTraceTracker",
    torch/csrc/cuda/CUDAPluggableAllocator.cpp) when the first NCCL process group starts, and
    NCCL could not register managed memory anyway (no IPC handle: see README, "Multi-GPU and
    shared GPUs"). Said now, with the fix, instead of at ``init_process_group``."""
    value = os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "")
    try:
        on = parse_bool(value, "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK")
    except ConfigError:
        on = False
    if on:
        raise ConfigError(
            f"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK={value} registers torch's own caching-allocator "
            "segments with NCCL, but under umrt torch allocates through umrt's pluggable allocator (managed "
            "memory, which NCCL cannot register): unset it; NCCL then copies through its own buffers")


def _start(cfg: Config) -> Session:
    # optional: GPU start only (the CUDA backend and the pool need numpy); `import umrt` stays light
    from umrt.allocators import cupy as cupy_alloc

    # optional: GPU start only, as above
    from umrt.allocators.managed import ManagedPool

    # optional: GPU start only, as above
    from umrt.backends.cuda import CudaBackend

    backend = CudaBackend(cfg.device, swap_copy=cfg.swap_copy)
    _, total = backend.mem_info()
    held = _join_share(cfg, total)
    budget = held.held if held is not None else cfg.budget().resolve(total)
    arena = cfg.arena(budget)
    pool = ManagedPool(backend, _layout_factory(arena), populate_limit=budget)
    session = Session(cfg, active=True, backend=backend, pool=pool, budget_bytes=budget, share=held)
    session.steady = _steady_server(cfg, backend, pool)
    stats.attach(pool=pool, backend=backend, steady=session.steady)
    cupy_alloc.set_pool(session.steady, front=session.steady.front)
    _install_torch(session)
    session.runtime = _attach_runtime(session)
    if held is not None:
        _keep_share(session)
    if cfg.telemetry:
        # optional: NVML telemetry, only when asked for (UMRT_TELEMETRY)
        from umrt.telemetry import Sampler

        session.telemetry = Sampler(cfg.device, pci_bus_id=_pci_bus_id(cfg.device)).start()
        atexit.register(session.telemetry.stop_and_report)
    return session


def _device_name(device: int) -> str:
    """``cuda:N``, with the GPU's PCI bus id where CuPy can read it."""
    bus = _pci_bus_id(device)
    return f"cuda:{device}" + (f" ({bus})" if bus else "")


def _device_id(device: int) -> str:
    """The GPU as every process names it, whatever its ``CUDA_VISIBLE_DEVICES``: its PCI bus
    id, else the index it has with no ``CUDA_VISIBLE_DEVICES``, else ``cuda-N``."""
    bus = _pci_bus_id(device)
    if bus:
        return f"pci-{bus}"
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    return f"cuda-{visible[device] if device < len(visible) and visible[device] else device}"


def _join_share(cfg: Config, total: int) -> share.Share | None:
    """This job's share of its GPU (:mod:`umrt.share`): fixed when ``UMRT_GPU_MEMORY`` was
    given, fair otherwise; None with ``UMRT_SHARE_DIR=off``.

    Raises:
        ShareError: the GPU cannot give this job its share (after ``UMRT_SHARE_WAIT``).
    """
    if cfg.shares_off:
        return None
    registry = share.Registry(cfg.share_dir or share.default_folder(), _device_id(cfg.device))
    fixed = cfg.budget().resolve(total) if cfg.gpu_memory is not None else None  # set: a fixed share
    minimum = cfg.share_minimum().resolve(total)
    held = share.join(registry, total, fixed=fixed, minimum=minimum, wait=cfg.share_wait,
                      label=share.job_label(), describe=_device_name(cfg.device))
    if held.others:
        print(f"umrt: {_device_name(cfg.device)} is shared with {held.others} other umrt job(s): this job plans "
              f"with {format_bytes(held.held)} ({held.mode} share)", file=sys.stderr)
    return held


def _keep_share(session: Session) -> None:
    """Move the job's budget with its share, at optimizer steps (where torch is in use)."""
    session.share.watch()
    if "torch" not in sys.modules:
        return
    # optional: the capture's hooks import torch, which a job that runs no torch never loads
    from umrt.capture.hooks import register_step_end_hook

    session.hooks.append(register_step_end_hook(lambda *_: move_share(session)))


def move_share(session: Session) -> int | None:
    """At a safe point (an optimizer step's end): the budget follows the job's share if
    it moved (others came or went). Returns the new budget, or None."""
    if session.share is None:
        return None
    new = session.share.step()
    if new is None or new == session.budget_bytes:
        return None
    old, session.budget_bytes = session.budget_bytes, new
    session.pool.populate_limit = new
    if session.runtime is not None:
        # optional: the live bridge exists only where torch is in use (it was imported to start it)
        from umrt.drive.live import set_budget

        set_budget(session.runtime, new)
    print(f"umrt: {_device_name(session.config.device)}: this job's {session.share.mode} share moved from "
          f"{format_bytes(old)} to {format_bytes(new)} ({session.share.others} other umrt job(s))", file=sys.stderr)
    return new


def _steady_server(cfg: Config, backend: Any, pool: Any) -> Any:
    """The allocator torch and CuPy call: the pool, plus the native steady state."""
    # optional: GPU start only (the server needs the pool and the CUDA backend, which need numpy)
    from umrt.native.server import BackendCalls, SteadyServer

    front = None
    if cfg.native:
        # optional: GPU start only: building the native libraries needs torch's cpp_extension
        from umrt.native.binding import native_library

        # optional: same
        from umrt.native.front import load_front

        front = load_front()
        if front is not None and native_library() is None:  # built now, not at the first steady step
            front = None
    server = SteadyServer(pool, front=front, calls=BackendCalls(backend), device=cfg.device, enabled=cfg.native)
    if front is not None:  # what the front declines goes to the server through umrt's callbacks
        # optional: GPU start only; the callbacks need no CUDA torch
        from umrt.allocators.torch import make_callbacks, record_stream_callback

        _, _, alloc_address, free_address = make_callbacks(server)
        front.set_fallback(alloc_address, free_address, record_stream_callback())
    return server


def _pci_bus_id(device: int) -> str | None:
    """The CUDA device's PCI bus id, so NVML samples the same GPU under CUDA_VISIBLE_DEVICES."""
    try:
        import cupy

        return str(cupy.cuda.runtime.deviceGetPCIBusId(device))
    except Exception:  # noqa: BLE001 - no CuPy: fall back to the index
        return None


def _layout_factory(arena: int | None) -> Any:
    # optional: GPU start only (the pool needs numpy); `import umrt` stays light
    from umrt.allocators.managed import default_layout_factory

    # optional: GPU start only, as above
    from umrt.memory.pool import LifetimePool

    if arena is None:
        return default_layout_factory

    return lambda backend: LifetimePool(backend, short_lived_bytes=arena, live_feed=True)


def _install_torch(session: Session) -> None:
    """Route torch if a CUDA build is importable; a CPU build is a note, not an error."""
    try:
        import torch
    except ImportError:
        return
    if torch.version.cuda is None:
        session.notes.append("torch is a CPU build: only CuPy allocations are managed")
        return
    # optional: a CUDA build of torch only
    from umrt.allocators import torch as torch_alloc

    torch_alloc.install(session.steady, front=session.steady.front)
    session.backend.set_compute_stream(torch.cuda.current_stream(session.config.device).cuda_stream)
    _follow_set_device(torch)


_followed: set[int] = set()  # id()s of the device setters already wrapped


def _follow_set_device(torch: Any) -> None:
    """Wrap ``torch.cuda.set_device`` and ``torch.accelerator.set_device_index`` so that a
    script choosing its GPU after umrt started is followed (:func:`follow_device`)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    for owner, name in ((torch.cuda, "set_device"), (accelerator, "set_device_index")):
        original = getattr(owner, name, None) if owner is not None else None
        if original is None or id(original) in _followed:
            continue

        def set_and_follow(device: Any, _original: Any = original) -> None:
            _original(device)
            follow_device(int(torch.cuda.current_device()))

        set_and_follow.__doc__ = original.__doc__
        _followed.add(id(set_and_follow))
        setattr(owner, name, set_and_follow)


def follow_device(device: int) -> bool:
    """The script chose ``device`` (``torch.cuda.set_device``): umrt moves its session there
    if it holds no memory yet (the usual case: a rank sets its device before its first
    tensor). Returns True when umrt drives ``device`` afterwards."""
    global _current
    with _lock:
        session = _current
        if session is None or not session.active or session.config.device == device:
            return session is not None and session.active
        if session.pool.reserved_bytes():  # its pool made managed memory: tensors may live there
            log.warning("umrt: the script chose cuda:%d after umrt started on cuda:%d and made CUDA tensors "
                        "there: umrt stays on cuda:%d (set UMRT_DEVICE=%d, or call torch.cuda.set_device "
                        "before the first CUDA tensor)", device, session.config.device,
                        session.config.device, device)
            return False
    _disable_keeping(False)
    with _lock:
        _current = _start(session.config.replace(device=device))
    log.info("umrt: following the script to cuda:%d", device)
    return True


def _attach_runtime(session: Session) -> LiveBridge | None:
    """Start the policy live: the program's events fed to it (:class:`~umrt.drive.live.LiveBridge`)."""
    if "torch" not in sys.modules:
        return None
    # optional: the live bridge records with torch; `import umrt` must not import torch
    from umrt.drive.live import LiveBridge

    bridge = LiveBridge(session)
    bridge.start()
    return bridge


def current() -> Session | None:
    """The enabled session, or None."""
    return _current


def disable() -> None:
    """Stop the runtime policy and telemetry.

    torch cannot swap its allocator back: tensors already made stay in
    managed memory and new ones keep coming from umrt's pool (without
    prefetching) until the process ends.

    Raises:
        StoppedActing: with ``UMRT_STRICT``, a failure not raised yet (after
            everything is stopped).
    """
    _disable_keeping(False)


def _disable_keeping(other_error: bool) -> None:
    """:func:`disable`; ``other_error``: an exception is already on its way out
    (a ``with`` block's), so a strict failure is not raised over it (it was warned)."""
    global _current
    with _lock:
        session, _current = _current, None
    if session is None or not session.active:
        return
    for hook in session.hooks:
        hook.remove()
    if session.runtime is not None:
        session.runtime.close()
    if session.telemetry is not None:
        session.telemetry.stop_and_report()
    session.backend.synchronize()
    if session.share is not None:
        session.share.close()
    if session.runtime is not None and not other_error:
        session.runtime.raise_if_failed()


@contextlib.contextmanager
def session(config: Config | None = None, **overrides: Any) -> Iterator[Session]:
    """``with umrt.session(gpu_memory="20%device") as s:`` - :func:`enable` for a block, then :func:`disable`."""
    s = enable(config, **overrides)
    try:
        yield s
    except BaseException:
        _disable_keeping(True)
        raise
    _disable_keeping(False)
