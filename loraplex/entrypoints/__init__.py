"""Process entrypoints: the `loraplex serve` options, the launcher of the engine-core and API
server processes, one API server process, and replicas behind Ray Serve. They sit on top of
`platform/api`, which never imports them."""
