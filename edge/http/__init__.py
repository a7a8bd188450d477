"""the HTTP surface: the route table, handlers, the stream loop, middleware, TLS."""
