"""pipework: a trio-native pipeline and event-driven request processor."""

from __future__ import annotations

from ._errors import BackendError as BackendError
from ._errors import BackendUnreachable as BackendUnreachable
from ._errors import BorrowTimeout as BorrowTimeout
from ._errors import ConfigError as ConfigError
from ._errors import ConfigProblem as ConfigProblem
from ._errors import DeadlineExceeded as DeadlineExceeded
from ._errors import InternalError as InternalError
from ._errors import InvalidTransition as InvalidTransition
from ._errors import JobCancelled as JobCancelled
from ._errors import JobFailed as JobFailed
from ._errors import JobGone as JobGone
from ._errors import JobNotFound as JobNotFound
from ._errors import MergeConflict as MergeConflict
from ._errors import Overloaded as Overloaded
from ._errors import PipeContractError as PipeContractError
from ._errors import PipeworkError as PipeworkError
from ._errors import PoolConfigError as PoolConfigError
from ._errors import RegistrationError as RegistrationError
from ._errors import Rejected as Rejected
from ._errors import ResourcePoolClosed as ResourcePoolClosed
from ._errors import ResourcePoolError as ResourcePoolError
from ._errors import ResourceStartupError as ResourceStartupError
from ._errors import SignalError as SignalError
from ._errors import StateError as StateError
from ._errors import StoreUnavailable as StoreUnavailable
from ._errors import TemplateError as TemplateError
from ._errors import TemplateSyntaxError as TemplateSyntaxError
from ._logging import JsonFormatter as JsonFormatter
from ._metrics import Metrics as Metrics
from .backends._http import Backends as Backends
from .backends._http import http_pipe as http_pipe
from .backends._http_spec import HttpCall as HttpCall
from .backends._http_spec import Service as Service
from .backends._resilience_spec import BreakerSpec as BreakerSpec
from .backends._resilience_spec import HealthSpec as HealthSpec
from .backends._resilience_spec import HedgeSpec as HedgeSpec
from .backends._resilience_spec import HostSpec as HostSpec
from .backends._resilience_spec import OutlierSpec as OutlierSpec
from .backends._resilience_spec import RetrySpec as RetrySpec
from .container._app import Container as Container
from .container._app import ContainerConfig as ContainerConfig
from .container._app import create_app as create_app
from .container._callbacks import CallbackSigner as CallbackSigner
from .container._result_files import FileResults as FileResults
from .container._result_files import OwnedFiles as OwnedFiles
from .container._result_files import ResultFile as ResultFile
from .container._routes import Route as Route
from .dispatcher._admission import Admission as Admission
from .dispatcher._degrade import Refusals as Refusals
from .dispatcher._engine import Engine as Engine
from .dispatcher._job import ErrorInfo as ErrorInfo
from .dispatcher._job import JobView as JobView
from .dispatcher._job import Progress as Progress
from .dispatcher._queue import MemoryEventQueue as MemoryEventQueue
from .dispatcher._queue import QueueStatistics as QueueStatistics
from .dispatcher._status import Status as Status
from .dispatcher._store import MemoryJobStore as MemoryJobStore
from .dispatcher._weighted import WeightedPool as WeightedPool
from .dispatcher._weighted_config import Adaptive as Adaptive
from .dispatcher._weighted_config import PoolConfig as PoolConfig
from .dispatcher._weighted_config import Weights as Weights
from .dispatcher._weighted_statistics import KeyStatistics as KeyStatistics
from .dispatcher._weighted_statistics import PoolStatistics as PoolStatistics
from .pipes._catalogue import Catalogue as Catalogue
from .pipes._merge import MISSING as MISSING
from .pipes._merge import MergePolicy as MergePolicy
from .pipes._pipe import Context as Context
from .pipes._pipe import Pipe as Pipe
from .pipes._pipe import RequestUse as RequestUse
from .pipes._resources import ResourcePool as ResourcePool
from .pipes._resources import ResourcePoolStatistics as ResourcePoolStatistics
from .pipes._stages import BranchEnd as BranchEnd
from .pipes._stages import Chain as Chain
from .pipes._stages import GraphNode as GraphNode
from .pipes._stages import Parallel as Parallel
from .pipes._stages import Serial as Serial
from .pipes._stages import all_of as all_of
from .pipes._stages import any_of as any_of
from .pipes._stages import branch as branch
from .pipes._stages import graph as graph
from .pipes._stages import node as node
from .pipes._stages import quorum as quorum
from .pipes._stages import serial as serial
from .registry._config import GatewayConfig as GatewayConfig
from .registry._config import build_registry as build_registry
from .registry._config import config_from_dict as config_from_dict
from .registry._config import load_config as load_config
from .registry._config import loads_config as loads_config
from .registry._gateway import Gateway as Gateway
from .registry._registry import Registry as Registry

__version__ = "0.1.0"

__all__ = [
    "MISSING",
    "Adaptive",
    "Admission",
    "BackendError",
    "BackendUnreachable",
    "Backends",
    "BorrowTimeout",
    "BranchEnd",
    "BreakerSpec",
    "CallbackSigner",
    "Catalogue",
    "Chain",
    "ConfigError",
    "ConfigProblem",
    "Container",
    "ContainerConfig",
    "Context",
    "DeadlineExceeded",
    "Engine",
    "ErrorInfo",
    "FileResults",
    "Gateway",
    "GatewayConfig",
    "GraphNode",
    "HealthSpec",
    "HedgeSpec",
    "HostSpec",
    "HttpCall",
    "InternalError",
    "InvalidTransition",
    "JobCancelled",
    "JobFailed",
    "JobGone",
    "JobNotFound",
    "JobView",
    "JsonFormatter",
    "KeyStatistics",
    "MemoryEventQueue",
    "MemoryJobStore",
    "MergeConflict",
    "MergePolicy",
    "Metrics",
    "OutlierSpec",
    "Overloaded",
    "OwnedFiles",
    "Parallel",
    "Pipe",
    "PipeContractError",
    "PipeworkError",
    "PoolConfig",
    "PoolConfigError",
    "PoolStatistics",
    "Progress",
    "QueueStatistics",
    "Refusals",
    "RegistrationError",
    "Registry",
    "Rejected",
    "RequestUse",
    "ResourcePool",
    "ResourcePoolClosed",
    "ResourcePoolError",
    "ResourcePoolStatistics",
    "ResourceStartupError",
    "ResultFile",
    "RetrySpec",
    "Route",
    "Serial",
    "Service",
    "SignalError",
    "StateError",
    "Status",
    "StoreUnavailable",
    "TemplateError",
    "TemplateSyntaxError",
    "WeightedPool",
    "Weights",
    "__version__",
    "all_of",
    "any_of",
    "branch",
    "build_registry",
    "config_from_dict",
    "create_app",
    "graph",
    "http_pipe",
    "load_config",
    "loads_config",
    "node",
    "quorum",
    "serial",
]


def _fix_module_names() -> None:
    """Make the public classes and functions say they live here (``pipework.Engine``, not
    ``pipework.dispatcher._engine.Engine``) in reprs, tracebacks and docs, as trio does; the
    private module layout stays free to change."""
    for name in __all__:
        value = globals()[name]
        if isinstance(value, type) or callable(value):
            module = getattr(value, "__module__", None)
            if isinstance(module, str) and module.startswith(__name__ + "."):
                value.__module__ = __name__


_fix_module_names()
del _fix_module_names
