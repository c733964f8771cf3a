"""The launcher: start a job's rank and hot-spare processes on one host and supervise them.

``torchpass-p2p launch`` (:mod:`torchpass_p2p.cli.launch`) builds configuration 0, writes it and
the cluster key into a private run directory, starts one process per member with the environment
of :mod:`torchpass_p2p.agent.settings`, reports a dead child to its siblings as fast evidence,
optionally respawns it as a new spare, forwards signals and reaps everything at the end.

Modules, one job each:

- :mod:`.keyfile`: the run directory, the cluster key file and the HTTP bearer token.
- :mod:`.ports`: the children's ports, bound before they start and handed over.
- :mod:`.childspec`: pure: member ids, roles, addresses, configuration 0, each child's environment.
- :mod:`.slurm`: ``--nodes``, ``--node-rank`` and ``--run-id`` from a Slurm job step.
- :mod:`.outcome`: pure: when the launcher is done and with which exit code.
- :mod:`.children`: one child process in its own process group.
- :mod:`.evidence`: POST a dead child's evidence to its siblings' status pages.
- :mod:`.launcher`: the supervisor loop tying these together.
"""
