"""vapo_async.common: what several processes share, owned by none of them.

    engine      EngineConfig and the vLLM engine arguments (generators, the eval CLI, the learner's
                held-out evaluation engine)
    sampling    SamplingConfig (the learner's ``sampling``) and GroupSamplingConfig (a generator's)
    procs       stop_processes: signal -> wait -> SIGKILL (process groups too), on psutil
    orphans     spawned vLLM processes die with the process that spawned them (Linux)
    overrides   Python values and mappings as Hydra overrides

Nothing here imports learner/, generator/, controller/ or eval/.
"""
