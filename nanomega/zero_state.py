"""Sharded optimizer state: save and load this rank's shard, or full tensors by parameter name (resharding).

Idea: under ZeRO a checkpoint is naturally one file per rank: the fp32 master slices and the optimizer state
of the pieces this rank owns. That loads back only into the same layout (stage, dp size, buckets). To change
layout (saved at dp=2 zero=3, resumed at dp=4 zero=1), gather full tensors under the parameters' original
names -- every state tensor of an element-wise optimizer is shaped like its parameter -- and let the new
layout keep its own slices (load_full). Scalars (Adam's step) are the same on every piece of a group.
    one rank's shard:  (4 + 4 K) S bytes per group (master, K state tensors: Adam K = 2)
    by name:           (4 + 4 K) Psi_elements bytes, all-gathered to every rank
Lesson: lessons/02-data-parallel-and-zero.md
"""
import copy

import torch


def _copy(v):
    return v.clone() if torch.is_tensor(v) else copy.deepcopy(v)


def _elementwise(v):
    return torch.is_tensor(v) and v.dim() > 0


class ShardedState:
    """ZeroEngine's checkpoint methods (a mixin over the engine's groups, pieces and optimizer)."""

    def _layout(self):
        return dict(stage=self.stage, dp=self.axis.size, dp_rank=self.axis.rank,
                    groups=[g.numel for g in self.groups])

    def _frozen(self):
        """This rank's frozen parameters: ZeRO-3 shards, else the whole tensors."""
        if self.sharded:
            return [g.shard for g in self.sharded.frozen]
        return [p.data for p in self.module.parameters() if not p.requires_grad]

    def state_dict(self):
        """This rank's shard: fp32 master slices, frozen parameters, optimizer state of its pieces (copies)."""
        return dict(layout=self._layout(), master=[g.master.clone() for g in self.groups],
                    frozen=[t.clone() for t in self._frozen()], optimizer=copy.deepcopy(self.optimizer.state_dict()))

    def load_state_dict(self, sd):
        if sd["layout"] != self._layout():
            raise ValueError(f"ZeRO shard saved with layout {sd['layout']} cannot load into {self._layout()}; "
                             f"reshard it through full_state_dict(), optimizer_state_by_name() and load_full()")
        for t, saved in zip([g.master for g in self.groups] + self._frozen(), sd["master"] + sd["frozen"]):
            t.copy_(saved)
        self.optimizer.load_state_dict(sd["optimizer"])
        self._write_back()

    def _gather(self, g, shard):
        """The padded flat tensor of which `shard` is this rank's slice (stage 0: the shard is all of it)."""
        if self.stage == 0:
            return shard
        return self.axis.all_gather(torch.empty(g.padded, dtype=shard.dtype, device=shard.device), shard)

    def full_state_dict(self):
        """{name: full fp32 tensor} for every parameter of the module (tied ones once, under their first name)."""
        out = {}
        for g in self.groups:
            out.update(zip(g.names, (v.clone() for v in g.views(self._gather(g, g.master)))))
        for g in self.sharded.frozen if self.sharded else []:
            out.update(zip(g.names, (v.float().clone() for v in g.views(self._gather(g, g.shard)))))
        return {k: out[k] if k in out else p.detach().float().clone() for k, p in self.module.named_parameters()}

    def _group_state_kinds(self):
        """Per optimizer group: ({element-wise key: dtype}, {scalar key: value}), read from this rank's first
        piece of the group -- every rank has one (maybe empty), so all ranks agree on the keys."""
        kinds = []
        for group in self.optimizer.param_groups:
            state = self.optimizer.state.get(group["params"][0], {})
            kinds.append(({k: v.dtype for k, v in state.items() if _elementwise(v)},
                          {k: v for k, v in state.items() if not _elementwise(v)}))
        return kinds

    def optimizer_state_by_name(self):
        """{name: {state key: full tensor shaped like the parameter, or the scalar}} for trainable parameters."""
        if self.stage == 0:  # whole parameters: the state is full already (any optimizer)
            return {g.names[i]: {k: _copy(v) for k, v in self.optimizer.state.get(m, {}).items()}
                    for m, _, g, i, _, _ in self.pieces if g is not None}
        kinds, out = self._group_state_kinds(), {}
        for g in self.groups:
            per_param = [kinds[self.group_of[k]] for k in g.names]
            keys = {k: dtype for elementwise, _ in per_param for k, dtype in elementwise.items()}
            full = {}
            for key, dtype in keys.items():  # fill this rank's slice, all-gather the group
                shard = torch.zeros(g.shard_numel, dtype=dtype, device=g.device)
                for m, _, h, _, a, b in self.pieces:
                    if h is g and key in self.optimizer.state.get(m, {}):
                        shard[a - g.lo:b - g.lo] = self.optimizer.state[m][key]
                full[key] = g.views(self._gather(g, shard))
            for i, (name, (elementwise, scalars)) in enumerate(zip(g.names, per_param)):
                out[name] = {k: full[k][i].clone() for k in elementwise} | {k: _copy(v) for k, v in scalars.items()}
        return out

    @torch.no_grad()
    def load_full(self, params_by_name, optim_state_by_name=None):
        """Keep this rank's slices of full tensors given by name (saved in any layout): the fp32 masters, the
        model's parameters (frozen ones too) and, when given, the optimizer state."""
        missing = [k for k, _ in self.module.named_parameters() if k not in params_by_name]
        if missing:
            raise ValueError(f"load_full: no tensor for parameters {missing[:3]} (of {len(missing)} missing)")
        for g in self.groups:
            g.master.copy_(g.flatten([params_by_name[k] for k in g.names], torch.float32)[g.lo:g.hi])
        for g in self.sharded.frozen if self.sharded else []:
            g.shard.copy_(g.flatten([params_by_name[k] for k in g.names])[g.lo:g.hi])
        if not self.sharded:
            for k, p in self.module.named_parameters():
                if not p.requires_grad:
                    p.copy_(params_by_name[k])
        if optim_state_by_name is not None:
            self.optimizer.state.clear()
            for m, _, g, i, a, b in self.pieces:
                if g is None:  # an empty piece takes the keys of any parameter of its group
                    j = next(j for j, group in enumerate(self.optimizer.param_groups) if group["params"][0] is m)
                    st = next((optim_state_by_name[k] for k, jj in self.group_of.items()
                               if jj == j and optim_state_by_name.get(k)), {})
                    self.optimizer.state[m] = {k: m.new_zeros(0, dtype=v.dtype) if _elementwise(v) else _copy(v)
                                               for k, v in st.items()}
                    continue
                o, st = g.offsets[i], optim_state_by_name[g.names[i]]
                # element-wise state goes to the parameter's device at every stage (a checkpoint is read to the
                # CPU); scalars (Adam's step) stay where torch.optim keeps them, on the CPU
                self.optimizer.state[m] = {k: (v.to(m.device).reshape(-1)[a - o:b - o].clone().view(m.shape)
                                               if _elementwise(v) else _copy(v)) for k, v in st.items()}
        self._write_back()
