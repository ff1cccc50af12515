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
    Progress,
    Queued,
    Terminal,
    is_terminal,
)
from stagemesh.shared.engine.metrics import EngineMetrics
from stagemesh.shared.engine.request import AbortReason, RequestRecord, RequestState
from stagemesh.shared.engine.scheduler import (
    Scheduler,
    TickPlan,
    resolve_total_steps,
    validate_budget,
)

__all__ = [
    "AbortReason",
    "Aborted",
    "Completed",
    "EngineMetrics",
    "EngineRequest",
    "Event",
    "ExecutionMode",
    "Failed",
    "InvalidInputError",
    "NoStream",
    "Partial",
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
    "StepOutput",
    "Terminal",
    "TickPlan",
    "is_terminal",
    "resolve_total_steps",
    "validate_budget",
]
