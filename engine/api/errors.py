"""Errors as OpenAI's API returns them: `{"error": {"message", "type", "param", "code"}}` with the
HTTP status a client's retry logic expects (400 bad request, 401 key, 404 model, 413 body,
503 with Retry-After when the engine cannot take work now)."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.runtime.streaming_client import EngineBusyError, EngineDeadError

RETRY_AFTER_S = 1


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def engine_unavailable(error: Exception) -> APIError:
    return APIError(503, str(error), "service_unavailable", code="engine_busy" if isinstance(error, EngineBusyError)
                    else "engine_dead")


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of the API's routes answers in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        problem = error.errors()[0] if error.errors() else {}
        location = [str(part) for part in problem.get("loc", ()) if part != "body"]
        if problem.get("type") == "json_invalid":
            return bad_request("The request body is not valid JSON.").response()
        param = ".".join(location) or None
        where = f" at `{param}`" if param else ""
        return bad_request(f"Invalid request{where}: {problem.get('msg', 'malformed body')}.", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, str(error.detail), kind).response()

    @app.exception_handler(EngineBusyError)
    @app.exception_handler(EngineDeadError)
    async def unavailable(request: Request, error: Exception) -> JSONResponse:
        return engine_unavailable(error).response()
