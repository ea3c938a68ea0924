"""Ray-side code, one subpackage per process it runs in:

  driver/           the process of train.py / train_async.py: the cluster, placement, the trainer group's
                    proxy, the run session, the schedules' helpers, waiting on the rollout manager
  trainer/          each trainer rank's Ray actor
  rollout_manager/  the rollout manager's Ray actor: rollouts under their deadline, its steps, its errors
  engines/          the engine fleet the rollout manager drives: each engine's actor, health, recovery,
                    test-only faults
"""
