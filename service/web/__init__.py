"""The HTTP plumbing every feature shares: settings, authentication, middleware, the server's
protocol, problem details, JSON body routing, metrics, store calls off the event loop, error
wording, and the schemas' common field types."""
