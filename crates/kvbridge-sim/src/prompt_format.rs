//! How `kvbridge demo --workload shared-prefix` sends its prompts (`--prompt-format`): as
//! token ids, as text, or as chats, the way vLLM's clients send them.
//!
//! A shared-prefix request is a list of messages (the system prompt, then a document and a
//! question, or a chat's earlier turns and a new user message), each a run of vocabulary
//! token ids ([`Message`]). The three formats carry the same words:
//! - `ids`: a completion whose `prompt` is the messages' ids one after the other;
//! - `text`: a completion whose `prompt` is those ids' words, space-separated: the reference
//!   engine's tokenizer ([`model::tokenize`]) gives back exactly the `ids` format's ids;
//! - `chat`: `/v1/chat/completions` with one `messages` entry per message (`system`, `user`,
//!   `assistant`), each's `content` its words. The engine's chat template
//!   ([`model::chat_prompt`]) puts a role marker before each message and `<|assistant|>` at
//!   the end: the ids are the `ids` format's with those markers in between, one per message
//!   plus one.

use crate::model;
use serde::Serialize;
use serde_json::{json, Value};

/// `--prompt-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptFormat {
    /// A completion whose `prompt` is token ids (no tokenizer needed to route it).
    #[default]
    Ids,
    /// A completion whose `prompt` is a string.
    Text,
    /// A chat completion (`messages`).
    Chat,
}

impl PromptFormat {
    /// The flag's value.
    pub fn as_str(self) -> &'static str {
        match self {
            PromptFormat::Ids => "ids",
            PromptFormat::Text => "text",
            PromptFormat::Chat => "chat",
        }
    }
}

/// One message of a request: its role (`system`, `user`, `assistant`) and its token ids
/// (vocabulary words).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: &'static str,
    /// Vocabulary token ids.
    pub ids: Vec<u32>,
}

/// The words of vocabulary ids, space-separated (what [`model::tokenize`] turns back into
/// the same ids).
pub fn words(ids: &[u32]) -> String {
    ids.iter()
        .map(|&i| model::word(i).unwrap_or("?"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A streamed request of `messages`, answering `max_tokens` tokens, in `format`: its path
/// (`/v1/completions` or `/v1/chat/completions`) and its body.
pub fn request(
    messages: &[Message],
    max_tokens: u32,
    format: PromptFormat,
    model_name: &str,
) -> (&'static str, Value) {
    let ids = || {
        messages
            .iter()
            .flat_map(|m| m.ids.iter().copied())
            .collect::<Vec<u32>>()
    };
    match format {
        PromptFormat::Ids => (
            "/v1/completions",
            json!({"model": model_name, "prompt": ids(), "max_tokens": max_tokens,
                "stream": true}),
        ),
        PromptFormat::Text => (
            "/v1/completions",
            json!({"model": model_name, "prompt": words(&ids()),
                "max_tokens": max_tokens, "stream": true}),
        ),
        PromptFormat::Chat => (
            "/v1/chat/completions",
            json!({"model": model_name,
                "messages": messages
                    .iter()
                    .map(|m| json!({"role": m.role, "content": words(&m.ids)}))
                    .collect::<Vec<Value>>(),
                "max_tokens": max_tokens, "stream": true}),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::chat_tokens;

    fn conversation() -> Vec<Message> {
        vec![
            Message {
                role: "system",
                ids: vec![1, 2, 3],
            },
            Message {
                role: "user",
                ids: vec![4, 5],
            },
            Message {
                role: "assistant",
                ids: vec![6],
            },
            Message {
                role: "user",
                ids: vec![7, 4899],
            },
        ]
    }

    fn ids_of(body: &Value) -> Vec<u32> {
        serde_json::from_value(body["prompt"].clone()).unwrap()
    }

    #[test]
    fn text_tokenizes_to_the_ids_format_ids() {
        let m = conversation();
        let (path, ids) = request(&m, 4, PromptFormat::Ids, "m");
        assert_eq!(path, "/v1/completions");
        assert_eq!(ids_of(&ids), vec![1, 2, 3, 4, 5, 6, 7, 4899]);
        let (path, text) = request(&m, 4, PromptFormat::Text, "m");
        assert_eq!(path, "/v1/completions");
        assert_eq!(
            model::tokenize(text["prompt"].as_str().unwrap()),
            ids_of(&ids)
        );
    }

    #[test]
    fn a_chat_is_the_ids_with_the_templates_role_markers() {
        let m = conversation();
        let (path, chat) = request(&m, 4, PromptFormat::Chat, "m");
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(chat["messages"].as_array().unwrap().len(), 4);
        // As the engine tokenizes it (for generation and for `/tokenize`).
        let got = chat_tokens(chat.get("messages"), false).unwrap();
        let marker = |r: &str| model::tokenize(&format!("<|{r}|>"))[0];
        let mut want = vec![marker("system"), 1, 2, 3, marker("user"), 4, 5];
        want.extend([marker("assistant"), 6, marker("user"), 7, 4899]);
        want.push(marker("assistant"));
        assert_eq!(got, want);
        let words: Vec<u32> = got.into_iter().filter(|&t| t < model::VOCAB_SIZE).collect();
        assert_eq!(words, ids_of(&request(&m, 4, PromptFormat::Ids, "m").1));
    }
}
