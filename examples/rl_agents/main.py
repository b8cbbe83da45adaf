"""Reinforcement learning with RPC: one agent, several observers, CartPole.

The pattern of PyTorch's tutorial "Getting Started with Distributed RPC
Framework" (its RL part). Rank 0 runs the *agent*: the policy network and its
optimizer. Every other rank runs an *observer* that steps its own
gymnasium ``CartPole-v1``. The agent creates the observers remotely
(``rpc.remote(ob_info, Observer)``) and keeps RRefs to them; each episode it
tells every observer to play one (``ob_rref.rpc_async().run_episode(...)``),
and the observers ask the agent for each action through the agent's RRef
(``agent_rref.rpc_sync().select_action(...)``). When all episodes are in, the
agent makes one REINFORCE update from all of them. Training stops when the
running reward reaches the environment's reward threshold (475 for v1).

Run (1 agent + 2 observers, until solved; add ``--framework torch`` to run the
very same code on ``torch.distributed.rpc``)::

    python examples/rl_agents/main.py
    python examples/rl_agents/main.py --smoke          # low threshold, seconds
    torchrun --nproc-per-node 3 examples/rl_agents/main.py

Metrics go to ``--out`` (default ``examples/rl_agents/out/``): ``metrics.json``
and ``reward.png``.
"""

import argparse
import sys
import time
from pathlib import Path

import gymnasium as gym
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import launch, plot, rpc_framework, summary, write_metrics  # noqa: E402

ENV = "CartPole-v1"
SMOKE_THRESHOLD = 100.0

rpc = None  # torch.distributed.rpc or rrpc, chosen by --framework in run_worker


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, state):
        return F.softmax(self.affine2(F.relu(self.affine1(state))), dim=-1)


class Observer:
    """Lives on ranks 1..N: steps its own CartPole, asks the agent for every action."""

    def __init__(self, ob_id, seed):
        self.id = ob_id
        self.env = gym.make(ENV)
        self.env.reset(seed=seed)  # later resets continue this seeded sequence

    def run_episode(self, agent_rref):
        state, _ = self.env.reset()
        rewards = []
        while True:
            state = torch.as_tensor(state, dtype=torch.float32)
            action = agent_rref.rpc_sync().select_action(self.id, state)
            state, reward, terminated, truncated, _ = self.env.step(action)
            rewards.append(reward)
            if terminated or truncated:
                return rewards


class Agent:
    """Lives on rank 0: holds the policy and RRefs to all observers."""

    def __init__(self, world_size, args):
        self.agent_rref = rpc.RRef(self)
        self.ob_rrefs = {}
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(f"observer{ob_rank}")
            self.ob_rrefs[ob_info.id] = rpc.remote(
                ob_info, Observer, args=(ob_info.id, args.seed + ob_rank)
            )
        self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=args.lr)
        self.gamma = args.gamma
        # What each observer saw and did this episode. The log-probabilities are
        # computed again, batched, when the episode ends: one backward pass
        # instead of one per step, and the same result on every run (per-step
        # graphs, built on whichever RPC thread served the call, would be
        # summed in an order that changes from run to run).
        self.saved_states = {ob_id: [] for ob_id in self.ob_rrefs}
        self.saved_actions = {ob_id: [] for ob_id in self.ob_rrefs}
        # One generator per observer: the observers' calls interleave in any
        # order, yet a given seed always picks the same actions.
        self.generators = {
            ob_id: torch.Generator().manual_seed(args.seed + ob_id) for ob_id in self.ob_rrefs
        }
        self.running_reward = 0.0

    def select_action(self, ob_id, state):
        with torch.no_grad():
            probs = self.policy(state)
        action = torch.multinomial(probs, 1, generator=self.generators[ob_id]).item()
        self.saved_states[ob_id].append(state)
        self.saved_actions[ob_id].append(action)
        return action

    def run_episode(self):
        """Every observer plays one episode; returns {observer id: its rewards}."""
        futs = {
            ob_id: ob_rref.rpc_async().run_episode(self.agent_rref)
            for ob_id, ob_rref in self.ob_rrefs.items()
        }
        return {ob_id: fut.wait() for ob_id, fut in futs.items()}

    def finish_episode(self, rewards):
        """One REINFORCE step from all observers' episodes; returns the mean episode reward."""
        states, actions, returns = [], [], []
        for ob_id, ob_rewards in rewards.items():
            R, ob_returns = 0.0, []
            for r in reversed(ob_rewards):
                R = r + self.gamma * R
                ob_returns.insert(0, R)
            returns += ob_returns
            states += self.saved_states[ob_id]
            actions += self.saved_actions[ob_id]
            self.saved_states[ob_id], self.saved_actions[ob_id] = [], []
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + 1e-8)
        log_probs = Categorical(self.policy(torch.stack(states))).log_prob(torch.tensor(actions))
        loss = -(log_probs * returns).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

        ep_reward = sum(sum(r) for r in rewards.values()) / len(rewards)
        self.running_reward = 0.05 * ep_reward + 0.95 * self.running_reward
        return ep_reward


def train(world_size, args):
    agent = Agent(world_size, args)
    threshold = args.threshold or gym.spec(ENV).reward_threshold
    print(f"{world_size - 1} observers, {args.framework} RPC, target running reward {threshold:g}")
    history = {"episode reward": [], "running reward": []}
    steps, start = 0, time.perf_counter()
    for episode in range(1, args.max_episodes + 1):
        rewards = agent.run_episode()
        ep_reward = agent.finish_episode(rewards)
        steps += sum(len(r) for r in rewards.values())
        history["episode reward"].append(ep_reward)
        history["running reward"].append(agent.running_reward)
        elapsed = time.perf_counter() - start
        solved = agent.running_reward >= threshold
        if episode % args.log_interval == 0 or solved:
            print(
                f"episode {episode:4d}  reward {ep_reward:6.1f}"
                f"  running {agent.running_reward:6.1f}"
                f"  {steps / elapsed:6.0f} steps/s  {elapsed:6.1f} s",
                flush=True,
            )
        if solved:
            break
    return {
        "framework": args.framework,
        "observers": world_size - 1,
        "seed": args.seed,
        "threshold": threshold,
        "solved": solved,
        "episodes": episode,
        "seconds": round(elapsed, 2),
        "env_steps": steps,
        "steps_per_s": round(steps / elapsed, 1),
        "final_running_reward": agent.running_reward,
        **history,
    }


def report(m, out):
    json_path = write_metrics(str(out / "metrics.json"), m)
    series = {k: m[k] for k in ("episode reward", "running reward")}
    series[f"threshold ({m['threshold']:g})"] = [m["threshold"]] * m["episodes"]
    png_path = plot(str(out / "reward.png"), series, "episode", "reward", f"REINFORCE on {ENV}")
    rows = {
        "observers": m["observers"],
        "running reward": f"{m['final_running_reward']:.1f} (target {m['threshold']:g})",
        "solved": m["solved"],
        "time to threshold": f"{m['seconds']:.1f} s, {m['episodes']} episodes",
        "env steps": f"{m['env_steps']} ({m['steps_per_s']:.0f}/s, one RPC each)",
        "metrics": json_path,
        "plot": png_path,
    }
    print(summary(f"RL agent + observers ({m['framework']} RPC)", rows))


def run_worker(rank, world_size, args):
    global rpc
    rpc, _, _ = rpc_framework(args.framework)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny network; leave the cores to the workers
    if rank == 0:
        rpc.init_rpc("agent", rank=rank, world_size=world_size)
        metrics = train(world_size, args)
        report(metrics, Path(args.out))
    else:
        rpc.init_rpc(f"observer{rank}", rank=rank, world_size=world_size)
    rpc.shutdown()  # waits until every worker is done
    if rank == 0 and not metrics["solved"]:
        sys.exit(f"not solved in {args.max_episodes} episodes")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=["rrpc", "torch"], default="rrpc")
    parser.add_argument("--observers", type=int, default=2)
    parser.add_argument(
        "--smoke", action="store_true", help=f"stop at running reward {SMOKE_THRESHOLD:g}"
    )
    parser.add_argument("--threshold", type=float, help="default: the env's reward threshold")
    parser.add_argument("--max-episodes", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    args = parser.parse_args()
    if args.smoke:
        args.threshold = args.threshold or SMOKE_THRESHOLD
    launch(run_worker, args.observers + 1, args)


if __name__ == "__main__":
    main()
