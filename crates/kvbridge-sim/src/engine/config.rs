//! What an engine is told to be: its role and its settings.

use crate::cost::CostModel;
use crate::model::Model;
use crate::prefix_cache::DEFAULT_PREFIX_CACHE_TOKENS;
use kvbridge_pd::{KvLayout, KvSpec, PdConfig, PushPlan, TransferMode};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// Which part of disaggregated serving this engine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefills and sends KV through the PD layer.
    Prefill,
    /// Receives KV through the PD layer and decodes.
    Decode,
    /// Colocated: prefills and decodes itself, no transfer (the reference output).
    Both,
}

/// Everything an engine needs to start.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Role.
    pub role: Role,
    /// The model (name, KV spec per rank, world size).
    pub model: Model,
    /// Simulated speed.
    pub cost: CostModel,
    /// Host the PD receivers and announce listeners bind to (decode).
    pub bind_host: String,
    /// PD receiver (channel) port per rank (decode); missing or 0 picks a free port.
    pub init_ports: Vec<u16>,
    /// Announce port per rank (decode; the proxy's `--decoder-alloc-port`); missing or 0
    /// picks a free port.
    pub alloc_ports: Vec<u16>,
    /// Receive buffer per rank, bytes (decode).
    pub buffer_bytes: u64,
    /// The proxy's ZMQ PULL endpoint, `tcp://host:port` (prefill); `None`: outcomes dropped.
    pub proxy_endpoint: Option<String>,
    /// Deadline to retrieve a request's KV once announced (decode).
    pub retrieve_timeout: Duration,
    /// Deadline of one announcement (prefill).
    pub announce_timeout: Duration,
    /// Largest `max_tokens` accepted.
    pub max_tokens_limit: u32,
    /// TTL of a received request's pages (decode): KV that no decode request claims returns
    /// to the buffer after this long.
    pub kv_ttl: Duration,
    /// MLA only: prefiller rank 0 sends the (identical) KV once, to decoder rank 0; the
    /// decoder reads rank 0's copy for every rank (`mla_send_once`). Both roles must agree.
    pub mla_send_once: bool,
    /// Decode: how long a sender may take to acknowledge a fence before it is disconnected
    /// (`fence_timeout_sec`).
    pub fence_timeout: Duration,
    /// Prefill: push (write into the decoder's pages) or pull (the decoder reads)
    /// (`pd_transfer_mode`).
    pub transfer_mode: TransferMode,
    /// Tokens the prefix cache keeps (whole chunks; 0: no cache). See
    /// [`crate::prefix_cache`].
    pub prefix_cache_tokens: u64,
    /// Where to publish KV events (vLLM's `--kv-events-config` `endpoint`:
    /// `tcp://*:5557`, `tcp://127.0.0.1:0`); `None`: not published.
    pub kv_events_endpoint: Option<String>,
    /// The KV events' topic (vLLM's `topic`, empty by default).
    pub kv_events_topic: String,
    /// Prefill and decode between different TP sizes: the push that
    /// [`kvbridge_pd::PushPlan`] plans. The engine's PD senders (prefill) or receivers
    /// (decode) are then the plan's parts, one per lane, each of its part's size; the
    /// model is the decoder's split. `None`: one per rank, as many on both sides.
    pub push: Option<Arc<PushPlan>>,
}

impl EngineConfig {
    /// Defaults for `role` and `model`: free ports, 1 GiB buffer per rank, default cost.
    pub fn new(role: Role, model: Model) -> Self {
        Self {
            role,
            model,
            cost: CostModel::default(),
            bind_host: "127.0.0.1".into(),
            init_ports: Vec::new(),
            alloc_ports: Vec::new(),
            buffer_bytes: 1 << 30,
            proxy_endpoint: None,
            retrieve_timeout: Duration::from_secs(10),
            announce_timeout: Duration::from_secs(5),
            max_tokens_limit: 4096,
            kv_ttl: Duration::from_secs(60),
            mla_send_once: false,
            fence_timeout: Duration::from_secs(10),
            transfer_mode: TransferMode::Push,
            prefix_cache_tokens: DEFAULT_PREFIX_CACHE_TOKENS,
            kv_events_endpoint: None,
            kv_events_topic: String::new(),
            push: None,
        }
        .with_pd_env()
    }

    /// Takes the PD settings the engine passes to the PD layer (`mla_send_once`,
    /// `fence_timeout_sec`, `pd_transfer_mode`) from `pd`.
    pub fn apply_pd(&mut self, pd: &PdConfig) {
        self.mla_send_once = pd.mla_send_once;
        self.fence_timeout = pd.fence_timeout();
        self.transfer_mode = pd.pd_transfer_mode;
    }

    /// The PD settings of the environment (`KVBRIDGE_PD_*`, `LMCACHE_*`), when set; a bad
    /// value is logged and ignored here (`kvbridge engine` loads and checks them strictly).
    fn with_pd_env(mut self) -> Self {
        let env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with("KVBRIDGE_PD_") || k.starts_with("LMCACHE_"))
            .collect();
        if env.is_empty() {
            return self;
        }
        match PdConfig::from_sources(None, env, &[]) {
            Ok(pd) => self.apply_pd(&pd),
            Err(e) => tracing::warn!("ignoring the PD environment: {e}"),
        }
        self
    }

    /// The PD lanes of this engine (prefill: senders, decode: receivers), each `(rank,
    /// world size, KV spec, name)`: one per TP rank, or one per part of [`Self::push`].
    pub(super) fn lanes(&self) -> Vec<(u32, u32, KvSpec, String)> {
        let ws = self.model.world_size;
        match &self.push {
            None => (0..ws)
                .map(|r| (r, ws, self.model.spec, format!("r{r}")))
                .collect(),
            Some(plan) => {
                let n = plan.parts().len() as u32;
                plan.parts()
                    .iter()
                    .map(|p| {
                        let name = format!("p{}-d{}", p.prefiller_rank, p.decoder_rank);
                        (p.lane, n, plan.part_spec(p, self.model.spec), name)
                    })
                    .collect()
            }
        }
    }

    /// Checks that [`Self::push`], if any, plans for this model: the model must be the
    /// decoder's split (its ranks, heads per rank, dimensions, dtype and chunk size).
    pub(super) fn check_push(&self) -> Result<(), String> {
        let Some(plan) = &self.push else {
            return Ok(());
        };
        if self.mla_send_once {
            // Send-once would leave every lane but the first empty, and its decoder rank
            // waiting; the push already sends the latent once per decoder rank.
            return Err(
                "mla_send_once is for equal TP sizes; a push between different ones sends \
                 the latent once per decoder rank already"
                    .into(),
            );
        }
        let (d, spec) = (plan.decoder(), self.model.spec);
        let fits = match spec.layout {
            KvLayout::Standard {
                layers,
                kv_heads,
                head_dim,
            } => {
                !d.mla
                    && layers == d.layers
                    && kv_heads == d.heads_per_rank()
                    && head_dim == d.head_dim
            }
            KvLayout::Mla { layers, latent_dim } => {
                d.mla && layers == d.layers && latent_dim == d.head_dim
            }
        };
        if fits
            && d.tp_size == self.model.world_size
            && d.dtype == spec.dtype
            && d.block_tokens == spec.chunk_tokens
        {
            Ok(())
        } else {
            Err(format!(
                "the push is planned for decoder layout ({d}), the model is {spec} on {} ranks",
                self.model.world_size
            ))
        }
    }

    /// Whether each lane carries one whole rank's chunk of the model (no packing on the
    /// prefiller, no placing on the decoder): always without [`Self::push`]; with it, when
    /// every decoder rank has one part (prefiller TP <= decoder TP, and MLA).
    pub(super) fn lanes_are_ranks(&self) -> bool {
        self.push.as_ref().is_none_or(|plan| {
            plan.parts().len() == self.model.world_size as usize
                && plan
                    .parts()
                    .iter()
                    .enumerate()
                    .all(|(i, p)| p.decoder_rank == i as u32 && p.dst_head == 0)
        })
    }

    /// Decoder ranks that hold KV: all of them, or only rank 0 with MLA send-once.
    pub(super) fn decoding_ranks(&self) -> usize {
        if self.mla_send_once && self.model.spec.layout.is_mla() {
            1
        } else {
            self.model.world_size as usize
        }
    }

    /// Receivers that hold KV: one per lane with [`Self::push`]; else
    /// [`Self::decoding_ranks`].
    pub(super) fn receiving_ranks(&self) -> usize {
        self.push
            .as_ref()
            .map_or_else(|| self.decoding_ranks(), |plan| plan.parts().len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_pd::{Dtype, TpLayout, Translation};

    /// A push from 1 rank to 2 over 4 KV heads of 32, with 2 layers and 16-token chunks.
    fn plan_1_to_2() -> Arc<PushPlan> {
        let side = |tp| TpLayout {
            model: "m".into(),
            layers: 2,
            total_kv_heads: 4,
            head_dim: 32,
            mla: false,
            dtype: Dtype::Bf16,
            block_tokens: 16,
            block_order: TpLayout::CHUNK_ORDER.to_vec(),
            tp_rank: 0,
            tp_size: tp,
        };
        let t = Translation::new(&side(1), &side(2)).unwrap();
        Arc::new(PushPlan::new(&t).unwrap())
    }

    fn config(kv_heads: u32, world_size: u32) -> EngineConfig {
        let spec = KvSpec {
            chunk_tokens: 16,
            ..KvSpec::new(
                KvLayout::Standard {
                    layers: 2,
                    kv_heads,
                    head_dim: 32,
                },
                Dtype::Bf16,
            )
        };
        let model = Model {
            name: "m".into(),
            spec,
            world_size,
        };
        let mut c = EngineConfig::new(Role::Decode, model);
        c.mla_send_once = false;
        c.push = Some(plan_1_to_2());
        c
    }

    #[test]
    fn a_push_runs_only_on_the_decoders_split() {
        let ok = config(2, 2);
        ok.check_push().unwrap();
        assert!(ok.lanes_are_ranks());
        assert_eq!(ok.receiving_ranks(), 2);
        let lanes = ok.lanes();
        assert_eq!(lanes[1].3, "p0-d1");
        // The prefiller's split, or another rank count: refused, naming the layout.
        let e = config(4, 1).check_push().unwrap_err();
        assert!(e.contains("tp rank 0 of 2"), "{e}");
        let mut send_once = config(2, 2);
        send_once.mla_send_once = true;
        assert!(send_once.check_push().is_err());
    }
}
