"""stub"""
from __future__ import annotations
from quart_trio import QuartTrio
from frontend.http.context import ApiContext
MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
def add_messages_routes(app: QuartTrio, api: ApiContext) -> None:
    pass
