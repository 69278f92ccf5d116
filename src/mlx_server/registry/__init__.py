"""Several models in one server: which are offered (``catalog``), which are loaded and for
how long (``registry``), and what the routes lease a request's model from (``lease``: a
single model, or the registry's)."""
