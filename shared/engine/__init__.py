"""The step-machine engine shared by every stage: scheduler, compute thread, event streams."""

from stagemesh.shared.engine.adapter import (
    EngineRequest,
    ExecutionMode,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepBudget,
    StepOutput,
)
from stagemesh.shared.engine.engine import QueueFullError, RequestStream, StepEngine
from stagemesh.shared.engine.events import (
    Aborted,
    Completed,
    Event,
    Failed,
    Partial,
    Preempted,
    Progress,
    Queued,
    Terminal,
    is_terminal,
)
from stagemesh.shared.engine.interrupt import Interruptible, StepInterrupt, StepInterrupted
from stagemesh.shared.engine.metrics import EngineMetrics
from stagemesh.shared.engine.request import AbortReason, RequestRecord, RequestState
from stagemesh.shared.engine.scheduler import (
    PRIORITY_AGING_SECONDS,
    Scheduler,
    TickPlan,
    resolve_total_steps,
    validate_budget,
)

__all__ = [
    "PRIORITY_AGING_SECONDS",
    "AbortReason",
    "Aborted",
    "Completed",
    "EngineMetrics",
    "EngineRequest",
    "Event",
    "ExecutionMode",
    "Failed",
    "Interruptible",
    "InvalidInputError",
    "NoStream",
    "Partial",
    "Preempted",
    "Progress",
    "QueueFullError",
    "Queued",
    "RequestRecord",
    "RequestState",
    "RequestStream",
    "Scheduler",
    "StageAdapter",
    "StepBudget",
    "StepEngine",
    "StepInterrupt",
    "StepInterrupted",
    "StepOutput",
    "Terminal",
    "TickPlan",
    "is_terminal",
    "resolve_total_steps",
    "validate_budget",
]
