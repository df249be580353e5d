"""``/v1/files``: OpenAI's Files API, for the SDK's batch flow (``files.create(purpose="batch")``,
then ``batches.create(input_file_id=...)``, then ``files.content(output_file_id)``).

Uploaded files live in the database the front doors share (``api/batches/files.py``). A batch's
output and error files are read from its lines when asked for, in OpenAI's batch output
format; their ids name the batch (``file-<batch id>-output``, ``file-<batch id>-errors``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.engine import Engine
from starlette.datastructures import UploadFile

from api.batches import files, store
from api.batches.files import FileMeta
from api.batches.results import output_file
from api.batches.store import result_file
from api.deps import FrontDoorDep, TenantDep
from api.openapi import error_responses, link
from broker.db import utcnow
from broker.errors import (
    BodyTooLarge,
    InvalidRequest,
    NotFound,
    UnsupportedMediaType,
    UnsupportedParameter,
)
from schemas.vocab import ErrorCode

router = APIRouter(prefix="/v1/files", tags=["files"])

PURPOSES = ("batch",)
"""What kvgate takes files for: batch input. Fine-tuning and assistants files have no use here."""
_CONTENT_TYPE = "application/octet-stream"


_UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(PURPOSES)},
                    },
                }
            }
        },
    }
}
_FILE_ERRORS = (ErrorCode.UNAUTHORIZED, ErrorCode.NOT_FOUND)
_BY_ID = {"file_id": "$response.body#/id"}
_FILE_LINKS = {
    "GetFile": link("GET", "/v1/files/{file_id}", "The file's description.", _BY_ID),
    "FileContent": link("GET", "/v1/files/{file_id}/content", "The file's bytes.", _BY_ID),
    "DeleteFile": link("DELETE", "/v1/files/{file_id}", "Delete the file.", _BY_ID),
    "BatchFromFile": link(
        "POST",
        "/v1/batches",
        "Run the file's lines as a batch.",
        request_body={"input_file_id": "$response.body#/id"},
    ),
}


@router.post(
    "",
    status_code=200,
    openapi_extra=_UPLOAD_DOC,
    responses={
        200: {"description": "The file, stored.", "links": _FILE_LINKS},
        **error_responses(
            ErrorCode.INVALID_REQUEST,
            ErrorCode.UNSUPPORTED_PARAMETER,
            ErrorCode.BODY_TOO_LARGE,
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            ErrorCode.UNAUTHORIZED,
        ),
    },
)
async def create_file(request: Request, door: FrontDoorDep, tenant: TenantDep) -> dict[str, Any]:
    limit = door.settings.max_body_bytes * 64
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the upload exceeds {limit} bytes")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise UnsupportedMediaType("upload the file as multipart/form-data")
    async with request.form(max_part_size=limit) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose not in PURPOSES:
            raise UnsupportedParameter(
                f"purpose must be one of {', '.join(PURPOSES)}",
                param="purpose",
            )
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("'file' is required", param="file")
        content = await upload.read()
        filename = (upload.filename or "upload.jsonl")[:255]
    if len(content) > limit:
        raise BodyTooLarge(f"the upload exceeds {limit} bytes")
    meta = FileMeta(f"file-{uuid.uuid4().hex}", str(purpose), filename, len(content), utcnow())
    await asyncio.to_thread(files.create_file, door.batch_engine, meta, tenant.id, content)
    return file_json(meta)


@router.get("", responses=error_responses(ErrorCode.INVALID_REQUEST, ErrorCode.UNAUTHORIZED))
async def list_files(
    door: FrontDoorDep,
    tenant: TenantDep,
    purpose: str | None = None,
    limit: int = Query(default=100, ge=1, le=10_000),
) -> dict[str, Any]:
    found = await asyncio.to_thread(files.list_files, door.batch_engine, tenant.id, purpose, limit)
    return {"object": "list", "data": [file_json(f) for f in found], "has_more": False}


@router.get("/{file_id}", responses=error_responses(*_FILE_ERRORS))
async def get_file(file_id: str, door: FrontDoorDep, tenant: TenantDep) -> dict[str, Any]:
    found = await _find(door, tenant.id, file_id)
    if isinstance(found, _BatchFile):
        # Its size is known only by reading it: a page at a time, never the whole of it.
        size = 0
        async for chunk in found.chunks():
            size += len(chunk)
        return file_json(replace(found.meta, bytes=size))
    return file_json(found[0])


@router.get(
    "/{file_id}/content",
    response_class=Response,
    responses={
        200: {
            "description": "The file's bytes (a batch's output or error file: JSONL).",
            "content": {_CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        },
        **error_responses(*_FILE_ERRORS),
    },
)
async def file_content(file_id: str, door: FrontDoorDep, tenant: TenantDep) -> Response:
    found = await _find(door, tenant.id, file_id)
    if isinstance(found, _BatchFile):
        return StreamingResponse(found.chunks(), media_type=_CONTENT_TYPE)
    return Response(found[1], media_type=_CONTENT_TYPE)


@router.delete("/{file_id}", responses=error_responses(*_FILE_ERRORS))
async def delete_file(file_id: str, door: FrontDoorDep, tenant: TenantDep) -> dict[str, Any]:
    deleted = await asyncio.to_thread(files.delete_file, door.batch_engine, tenant.id, file_id)
    if not deleted:
        raise NotFound(f"no file {file_id!r}")
    return {"id": file_id, "object": "file", "deleted": True}


@dataclass(frozen=True, slots=True)
class _BatchFile:
    """A batch's output or error file: read from its lines, a page at a time, when asked for."""

    meta: FileMeta
    engine: Engine
    batch_id: str
    statuses: frozenset[str]
    page_lines: int

    def chunks(self) -> AsyncIterator[bytes]:
        return output_file(self.engine, self.batch_id, self.statuses, self.page_lines)


async def _find(
    door: FrontDoorDep, tenant: str, file_id: str
) -> tuple[FileMeta, bytes] | _BatchFile:
    """An uploaded file with its content, or a batch's output or error file."""
    named = result_file(file_id)
    if named is not None:
        batch_id, statuses = named
        view = await asyncio.to_thread(store.get_batch, door.batch_engine, tenant, batch_id)
        if view is not None:
            created = view.batch.finished_at or view.batch.created_at
            meta = FileMeta(file_id, "batch_output", f"{file_id}.jsonl", 0, created)
            return _BatchFile(
                meta, door.batch_engine, batch_id, statuses, door.settings.batch_page_lines
            )
    found = await asyncio.to_thread(files.read_file, door.batch_engine, tenant, file_id)
    if found is None:  # another tenant's file is indistinguishable from none
        raise NotFound(f"no file {file_id!r}")
    return found


def file_json(meta: FileMeta) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": "file",
        "bytes": meta.bytes,
        "created_at": int(meta.created_at.timestamp()),
        "filename": meta.filename,
        "purpose": meta.purpose,
        "status": "processed",
    }
