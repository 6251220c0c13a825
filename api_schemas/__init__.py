"""The wire contract of Engram Service: pydantic models only, no behaviour.

One module per resource; import the public names from here (``from api_schemas import Job``):

- :mod:`~api_schemas.common`: the strict base, problems, name patterns and paging
- :mod:`~api_schemas.models`: model registration
- :mod:`~api_schemas.records`: chat messages, record shapes and dataset references
- :mod:`~api_schemas.concepts`: concepts and their collection
- :mod:`~api_schemas.jobs`: jobs
- :mod:`~api_schemas.job_kinds`: jobs typed by their kind (a finished job's result as its model)
- :mod:`~api_schemas.edit_options`: the edit options (``unlearn``, ``compose``)
- :mod:`~api_schemas.variants`: variants and their files
- :mod:`~api_schemas.universes`: universes, their build and storage
- :mod:`~api_schemas.evaluation`: probes, evaluation and generation
- :mod:`~api_schemas.calibration`: calibration
- :mod:`~api_schemas.maps`: engram maps
- :mod:`~api_schemas.health`: liveness and readiness
"""

from api_schemas.calibration import (
    BlockIndices,
    CalibrateRequest,
    Calibration,
    CalibrationCandidate,
    CalibrationJobResult,
    CalibrationRecommendation,
    CalibrationResult,
    CalibrationSubmission,
    CandidateOptions,
    ModuleSetPreset,
    ModuleSuffixes,
    SplitScore,
)
from api_schemas.common import (
    CONCEPT_NAME_PATTERN,
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    MODEL_ID_PATTERN,
    NEXT_CURSOR_HEADER,
    NOT_BLANK,
    SOURCE_PATTERN,
    DictReadable,
    Problem,
    Strict,
    exactly_one_of,
)
from api_schemas.concepts import (
    CollectionReport,
    Concept,
    ConceptCreate,
    ConceptModelState,
    ConceptSubmission,
    TruncatedRecords,
    UncountedRecords,
)
from api_schemas.edit_options import (
    MAX_MODULE_STRENGTH,
    VLLM_LORA_RANKS,
    Coefficient,
    ComposeRequest,
    EditOptions,
    UnlearnRequest,
)
from api_schemas.evaluation import (
    EvaluateRequest,
    EvaluationResult,
    GeneratedText,
    GenerateRequest,
    GenerationResult,
    Probe,
    ProbeRecord,
    ProbeScore,
    ProbeSummary,
)
from api_schemas.health import Health, Identity, Readiness
from api_schemas.job_kinds import JOB_MODELS, CalibrateJob, EvaluateJob, GenerateJob
from api_schemas.jobs import Job, JobProgress, JobResult
from api_schemas.maps import ConceptMap, EngramMap, MapLayer, MapLeftOut
from api_schemas.models import Layer, Model, ModelCreate
from api_schemas.records import (
    CHAT_ROLES,
    CONVERSATION_RULES,
    DATASET_URI_PATTERN,
    RECORD_SCHEMA,
    SHAREGPT_SPEAKERS,
    ChatMessage,
    DatasetColumns,
    DatasetReference,
    DatasetReferenceView,
    DatasetRows,
    Role,
)
from api_schemas.universes import (
    Universe,
    UniverseBytes,
    UniverseCreate,
    UniverseGroups,
    UniverseKeyUsage,
    UniverseMember,
    UniverseStatusCounts,
    UniverseSubmission,
    UniverseUsage,
)
from api_schemas.variants import Variant, VariantFile, VariantSubmission

__all__ = [
    "BlockIndices",
    "CHAT_ROLES",
    "CONCEPT_NAME_PATTERN",
    "CONVERSATION_RULES",
    "CalibrateJob",
    "CalibrateRequest",
    "Calibration",
    "CalibrationCandidate",
    "CalibrationJobResult",
    "CalibrationRecommendation",
    "CalibrationResult",
    "CalibrationSubmission",
    "CandidateOptions",
    "ChatMessage",
    "Coefficient",
    "CollectionReport",
    "ComposeRequest",
    "Concept",
    "ConceptCreate",
    "ConceptMap",
    "ConceptModelState",
    "ConceptSubmission",
    "DATASET_URI_PATTERN",
    "DEFAULT_PAGE_SIZE",
    "DatasetColumns",
    "DatasetReference",
    "DatasetReferenceView",
    "DatasetRows",
    "DictReadable",
    "EditOptions",
    "EngramMap",
    "EvaluateJob",
    "EvaluateRequest",
    "EvaluationResult",
    "GenerateJob",
    "GenerateRequest",
    "GeneratedText",
    "GenerationResult",
    "Health",
    "Identity",
    "JOB_MODELS",
    "Job",
    "JobProgress",
    "JobResult",
    "Layer",
    "MAX_MODULE_STRENGTH",
    "MAX_PAGE_SIZE",
    "MODEL_ID_PATTERN",
    "MapLayer",
    "MapLeftOut",
    "Model",
    "ModelCreate",
    "ModuleSetPreset",
    "ModuleSuffixes",
    "NEXT_CURSOR_HEADER",
    "NOT_BLANK",
    "Probe",
    "ProbeRecord",
    "ProbeScore",
    "ProbeSummary",
    "Problem",
    "RECORD_SCHEMA",
    "Readiness",
    "Role",
    "SHAREGPT_SPEAKERS",
    "SOURCE_PATTERN",
    "SplitScore",
    "Strict",
    "TruncatedRecords",
    "UncountedRecords",
    "Universe",
    "UniverseBytes",
    "UniverseCreate",
    "UniverseGroups",
    "UniverseKeyUsage",
    "UniverseMember",
    "UniverseStatusCounts",
    "UniverseSubmission",
    "UniverseUsage",
    "UnlearnRequest",
    "VLLM_LORA_RANKS",
    "Variant",
    "VariantFile",
    "VariantSubmission",
    "exactly_one_of",
]
