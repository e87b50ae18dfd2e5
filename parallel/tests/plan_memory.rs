//! The memory model's parameter counts against the models themselves: every family built and
//! its parameters counted (`Module::num_parameters`), for the features the shape describes
//! (biases, learned positions, token types, a gated MLP, grouped-query attention, a tied or
//! untied head, a head transform).

use meshgrad_nn::bert::BertForMaskedLM;
use meshgrad_nn::{BertConfig, Gpt, GptConfig, Llama, LlamaConfig, Module};
use meshgrad_parallel::plan::memory::{estimate_inference, num_parameters};
use meshgrad_tensor::{DType, Device};

#[test]
fn gpt_counts_match_the_model() {
    for bias in [true, false] {
        let c = GptConfig {
            vocab_size: 97,
            block_size: 16,
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            dropout: 0.0,
            bias,
            layer_norm_eps: 1e-5,
        };
        let model = Gpt::new(c, 0, DType::F32, Device::Cpu).unwrap();
        assert_eq!(
            num_parameters(&c.shape()),
            Some(model.num_parameters() as u64),
            "bias {bias}"
        );
    }
}

#[test]
fn llama_counts_match_the_model() {
    for (kv, tied) in [(4, false), (2, false), (1, true)] {
        let mut c = LlamaConfig::new(101, 16, 32, 2, 4);
        c.n_kv_head = kv;
        c.tie_embeddings = tied;
        c.intermediate_size = 48;
        let model = Llama::new(c, 0, DType::F32, Device::Cpu).unwrap();
        assert_eq!(
            num_parameters(&c.shape()),
            Some(model.num_parameters() as u64),
            "n_kv_head {kv}, tied {tied}"
        );
    }
}

#[test]
fn mixtral_counts_match_the_model() {
    // Experts, routers and the rest: the model's own count.
    for (experts, k) in [(4, 2), (3, 1)] {
        let mut c = LlamaConfig::new(101, 16, 32, 2, 4);
        c.n_kv_head = 2;
        c.intermediate_size = 24;
        c.moe = Some(meshgrad_nn::moe::MoeSettings::new(experts, k));
        let model = Llama::new(c, 0, DType::F32, Device::Cpu).unwrap();
        assert_eq!(
            num_parameters(&c.shape()),
            Some(model.num_parameters() as u64),
            "{experts} experts"
        );
    }
}

#[test]
fn bert_counts_match_the_model() {
    let c = BertConfig {
        vocab_size: 61,
        hidden_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 64,
        max_position_embeddings: 16,
        ..BertConfig::default()
    };
    let model = BertForMaskedLM::new(c, 0, DType::F32, Device::Cpu).unwrap();
    assert_eq!(
        num_parameters(&c.shape()),
        Some(model.num_parameters() as u64)
    );
}

#[test]
fn inference_counts_the_parameters_and_no_model_states() {
    let shape = LlamaConfig::new(101, 16, 32, 2, 4).shape();
    let est = estimate_inference(&shape, 8);
    assert_eq!(est.params, num_parameters(&shape).unwrap() * 4);
    assert_eq!(est.grads + est.optimizer, 0);
    assert!(est.activations > 0 && est.total == est.params + est.activations);
}
