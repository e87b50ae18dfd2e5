//! A model's [`ModelShape`] from a Hugging Face `config.json` (`meshgrad plan --hf-config`):
//! GPT-2 (`"model_type": "gpt2"`), BERT (`"bert"`) and Llama (`"llama"`, and `"mistral"`,
//! which has Llama's shapes) and Mixtral (`"mixtral"`, its experts and experts per token), read
//! by the same readers `--init-from` uses.

use meshgrad_nn::state::{hf_bert, hf_gpt2, hf_llama, hf_mixtral};
use meshgrad_nn::ModelShape;

/// The shape `text` (a `config.json`, named `origin` in errors) describes, with `seq` positions.
pub fn shape_from_config(text: &str, origin: &str, seq: usize) -> Result<ModelShape, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{origin}: not a JSON config ({e})"))?;
    let kind = v.get("model_type").and_then(|t| t.as_str()).unwrap_or("");
    let err = |e: meshgrad_tensor::Error| format!("{origin}: {e}");
    let mut shape = match kind {
        "gpt2" => hf_gpt2::gpt_config_from_hf_json(text)
            .map_err(err)?
            .0
            .shape(),
        "bert" => hf_bert::bert_config_from_hf_json(text)
            .map_err(err)?
            .shape(),
        "llama" | "mistral" => hf_llama::llama_config_from_hf_json(text)
            .map_err(err)?
            .shape(),
        "mixtral" => hf_mixtral::mixtral_config_from_hf_json(text)
            .map_err(err)?
            .shape(),
        other => {
            return Err(format!(
                "{origin}: model_type '{other}' is not one the planner reads (gpt2, bert, llama, mistral, mixtral)"
            ))
        }
    };
    shape.positions = seq;
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_llama_config_gives_its_shape() {
        // Llama-2-7B's config.json (the fields the reader needs).
        let text = r#"{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"}"#;
        let s = shape_from_config(text, "config.json", 2048).unwrap();
        assert_eq!(
            (s.n_layer, s.n_embd, s.ffn, s.positions),
            (32, 4096, 11008, 2048)
        );
        // 6.74 B parameters, as published for Llama 2 7B.
        let p = crate::plan::memory::num_parameters(&s).unwrap();
        assert_eq!(p, 6_738_415_616);
    }

    #[test]
    fn a_mixtral_config_counts_its_experts() {
        // Mixtral-8x7B's config.json (the fields the reader needs).
        let text = r#"{"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "tie_word_embeddings": false, "hidden_act": "silu",
            "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}"#;
        let s = shape_from_config(text, "config.json", 4096).unwrap();
        assert_eq!((s.n_experts, s.experts_per_token, s.ffn), (8, 2, 14336));
        // 46,702,792,704 parameters: the count of Mixtral-8x7B's checkpoint (46.7 B as
        // published), the 8 experts and the routers included.
        let p = crate::plan::memory::num_parameters(&s).unwrap();
        assert_eq!(p, 46_702_792_704);
    }
}
