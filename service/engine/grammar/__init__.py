"""Grammar compilation out of the server's process: a small pool of compiler processes (:mod:`.compile_pool`) and
what runs in each (:mod:`.compile_worker`)."""
