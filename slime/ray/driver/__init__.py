"""The driver process (train.py, train_async.py): it joins the Ray cluster, places the job, starts the
rollout manager and the trainer ranks, and runs the loop through their proxies."""
