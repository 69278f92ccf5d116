"""Several models in one server: which are offered (``catalog``), which are loaded and for
how long (``registry``), and the routing service the protocols use in front of them
(``routing``)."""
