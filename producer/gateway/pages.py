"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), the OpenAPI document's pages, with every script, style and
icon they load served by the gateway itself (``/docs/assets/``) from the fastapi-offline package (the ``http``
extra; MIT, carrying Swagger UI's Apache-2.0 and ReDoc's MIT bundles): FastAPI's own pages load them from a
CDN, and were blank on a host without the internet. Public, as the document is: nothing of a tenant is in
them.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS = "/docs/assets"  # under /docs: the front layer names the pages and their assets one route ("docs")


def install(app: FastAPI) -> None:
    """The two pages and their assets on ``app`` (made with ``docs_url=None, redoc_url=None``)."""
    app.mount(ASSETS, StaticFiles(directory=str(files("fastapi_offline") / "static")), name="docs-assets")

    async def swagger(http: Request) -> HTMLResponse:
        root = http.scope.get("root_path", "")
        # No validator badge: Swagger UI would load it from validator.swagger.io.
        return get_swagger_ui_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})

    async def redoc(http: Request) -> HTMLResponse:
        root = http.scope.get("root_path", "")
        return get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{ASSETS}/favicon.png", with_google_fonts=False)

    app.add_route("/docs", swagger, methods=["GET"], include_in_schema=False)
    app.add_route("/redoc", redoc, methods=["GET"], include_in_schema=False)
