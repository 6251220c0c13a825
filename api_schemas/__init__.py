"""The wire contract of Engram Service: pydantic models only, no behaviour."""

from api_schemas.models import *  # noqa: F403
