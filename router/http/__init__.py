"""The HTTP side of the gateway: the edge server and its dispatch (`edge`, `dispatch`), the
OpenAI endpoints, operational endpoints and admin API of the control application, error answers.

Nothing is imported here: the proxy imports `router.http.edge` for its request and response
types, and the handlers import the proxy, so an eager package would be a cycle.
"""
