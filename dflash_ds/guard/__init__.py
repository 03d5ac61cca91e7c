"""How a run starts and stops: the checks before launch and the start decision (launch.py), the
supervisor launch.sh becomes (supervise.py), the run lock (lock.py), stop signals (signals.py) and
the per-rank run control that ties them together (control.py).

It sits above runtime/: the run control installs runtime/'s watchdog and reads its checkpoints, while
nothing in runtime/ imports from here (the watchdog bounds runtime/'s own waits, so it stays there).
"""
