//! The KV-events codec against bytes written by vLLM's own msgspec classes (fixtures made by
//! tests/python/kv_events_fixtures.py with vLLM 0.32.0), against vLLM's decoder reading our
//! bytes (when a Python with vLLM is at hand), and against garbage.

use kvbridge_proto::kv_events::{
    decode_batch, encode_batch, message, split_message, BlockHash, BlockRemoved, BlockStored,
    DecodeLimits, KvEvent, KvEventBatch, KvEventsError,
};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kv_events");

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}/{name}.msgpack")).unwrap()
}

fn limits() -> DecodeLimits {
    DecodeLimits::default()
}

fn mixed() -> KvEventBatch {
    KvEventBatch {
        ts: 1.5,
        events: vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![
                    BlockHash::Int(1),
                    BlockHash::Int((1i128 << 63) + 5),
                    BlockHash::Int(-7),
                ],
                parent_block_hash: None,
                token_ids: (100..112).collect(),
                block_size: 4,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                group_idx: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::Int((1i128 << 63) + 5)],
                medium: Some("GPU".into()),
                group_idx: None,
            }),
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(0),
    }
}

fn all_fields() -> KvEventBatch {
    let h = |b: u8| BlockHash::Bytes(vec![b; 32]);
    KvEventBatch {
        ts: 1_700_000_000.25,
        events: vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![h(2), h(3)],
                parent_block_hash: Some(h(1)),
                token_ids: (5..13).collect(),
                block_size: 4,
                lora_id: Some(3),
                medium: Some("CPU".into()),
                lora_name: Some("adapter".into()),
                group_idx: Some(1),
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![h(3)],
                medium: None,
                group_idx: Some(1),
            }),
        ],
        data_parallel_rank: None,
    }
}

#[test]
fn vllm_written_batches_decode() {
    assert_eq!(decode_batch(&fixture("mixed"), &limits()).unwrap(), mixed());
    assert_eq!(
        decode_batch(&fixture("bytes_hashes_all_fields"), &limits()).unwrap(),
        all_fields()
    );
    assert_eq!(
        decode_batch(&fixture("empty"), &limits()).unwrap(),
        KvEventBatch {
            ts: 0.0,
            events: vec![],
            data_parallel_rank: None
        }
    );
    assert_eq!(
        std::fs::read_to_string(format!("{FIXTURES}/VLLM_VERSION"))
            .unwrap()
            .trim(),
        "0.32.0"
    );
}

/// Our encoder writes what vLLM's msgspec encoder writes, byte for byte (for batches whose
/// fields it keeps).
#[test]
fn our_bytes_are_vllms_bytes() {
    assert_eq!(encode_batch(&mixed()), fixture("mixed"));
    assert_eq!(
        encode_batch(&decode_batch(&fixture("empty"), &limits()).unwrap()),
        fixture("empty")
    );
    let b = all_fields();
    assert_eq!(decode_batch(&encode_batch(&b), &limits()).unwrap(), b);
}

/// vLLM's own `msgspec.msgpack.Decoder(type=KVEventBatch)` reads what we encode. Needs a
/// Python with vLLM: `KVBRIDGE_VLLM_PYTHON` (scripts/test-vllm.sh sets it to its .venv's; a
/// Python named there without vLLM fails the test), else `python3`, skipped with a note
/// when it has no vLLM.
#[test]
fn vllm_decodes_our_bytes() {
    let named = std::env::var("KVBRIDGE_VLLM_PYTHON").ok();
    let py = named.clone().unwrap_or_else(|| "python3".into());
    let has_vllm = std::process::Command::new(&py)
        .args(["-c", "import vllm.distributed.kv_events"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_vllm {
        assert!(
            named.is_none(),
            "KVBRIDGE_VLLM_PYTHON={py} cannot import vllm.distributed.kv_events"
        );
        eprintln!("SKIPPED: no vLLM in {py} (set KVBRIDGE_VLLM_PYTHON to a Python with vllm)");
        return;
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/kv_events_fixtures.py"
    );
    let dir = std::env::temp_dir().join(format!("kv_events_codec_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, batch, want) in [
        (
            "mixed",
            mixed(),
            r#"{"dp_rank": 0, "events": [{"block_hashes": [1, 9223372036854775813, -7], "block_size": 4, "group_idx": null, "lora_id": null, "lora_name": null, "medium": "GPU", "parent_block_hash": null, "token_ids": [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], "type": "BlockStored"}, {"block_hashes": [9223372036854775813], "group_idx": null, "medium": "GPU", "type": "BlockRemoved"}, {"type": "AllBlocksCleared"}], "ts": 1.5}"#,
        ),
        (
            "all",
            all_fields(),
            r#"{"dp_rank": null, "events": [{"block_hashes": ["0202020202020202020202020202020202020202020202020202020202020202", "0303030303030303030303030303030303030303030303030303030303030303"], "block_size": 4, "group_idx": 1, "lora_id": 3, "lora_name": "adapter", "medium": "CPU", "parent_block_hash": "0101010101010101010101010101010101010101010101010101010101010101", "token_ids": [5, 6, 7, 8, 9, 10, 11, 12], "type": "BlockStored"}, {"block_hashes": ["0303030303030303030303030303030303030303030303030303030303030303"], "group_idx": 1, "medium": null, "type": "BlockRemoved"}], "ts": 1700000000.25}"#,
        ),
    ] {
        let path = dir.join(format!("{name}.msgpack"));
        std::fs::write(&path, encode_batch(&batch)).unwrap();
        let out = std::process::Command::new(&py)
            .arg(script)
            .arg("check")
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want, "{name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// msgspec writes `array_like` tagged structs as `[tag, field, ...]`; such events decode too.
#[test]
fn array_form_events_decode() {
    // [ts, [["BlockStored", [9], 8, [1, 2], 2, nil, "GPU"], ["BlockRemoved", [9], nil],
    //       ["AllBlocksCleared"]]]
    let mut b = vec![0x92, 0xcb];
    b.extend_from_slice(&2.0f64.to_bits().to_be_bytes());
    b.push(0x93);
    b.extend_from_slice(&[0x97, 0xab]);
    b.extend_from_slice(b"BlockStored");
    b.extend_from_slice(&[0x91, 9, 8, 0x92, 1, 2, 2, 0xc0, 0xa3]);
    b.extend_from_slice(b"GPU");
    b.extend_from_slice(&[0x93, 0xac]);
    b.extend_from_slice(b"BlockRemoved");
    b.extend_from_slice(&[0x91, 9, 0xc0]);
    b.extend_from_slice(&[0x91, 0xb0]);
    b.extend_from_slice(b"AllBlocksCleared");
    let got = decode_batch(&b, &limits()).unwrap();
    assert_eq!(
        got.events,
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![BlockHash::Int(9)],
                parent_block_hash: Some(BlockHash::Int(8)),
                token_ids: vec![1, 2],
                block_size: 2,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                group_idx: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::Int(9)],
                medium: None,
                group_idx: None,
            }),
            KvEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn every_truncation_and_corruption_is_an_error_not_a_panic() {
    for name in ["mixed", "bytes_hashes_all_fields", "empty"] {
        let full = fixture(name);
        for cut in 0..full.len() {
            assert!(
                decode_batch(&full[..cut], &limits()).is_err(),
                "{name} cut at {cut}"
            );
        }
        let mut extra = full.clone();
        extra.push(0);
        assert_eq!(
            decode_batch(&extra, &limits()),
            Err(KvEventsError::TrailingBytes(1))
        );
        // Every single-byte corruption: an error or some batch, never a panic.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..full.len() {
            let mut bad = full.clone();
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bad[i] ^= (x as u8) | 1;
            let _ = decode_batch(&bad, &limits());
        }
    }
    assert_eq!(
        decode_batch(&[0x00], &limits()),
        Err(KvEventsError::Type { what: "the batch" })
    );
}

#[test]
fn announced_sizes_are_checked_before_allocation() {
    // An array of 2^32 - 1 events announced in 5 bytes.
    let mut b = vec![0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
    assert!(matches!(
        decode_batch(&b, &limits()),
        Err(KvEventsError::TooMany { what: "events", .. })
    ));
    // Under the limit but more than the bytes left.
    b = vec![0x92, 0x00, 0xdc, 0x10, 0x00];
    assert_eq!(decode_batch(&b, &limits()), Err(KvEventsError::Truncated));
    // A 4 GiB string key announced.
    b = vec![0x92, 0x00, 0x91, 0x81, 0xdb, 0xff, 0xff, 0xff, 0xff];
    assert_eq!(decode_batch(&b, &limits()), Err(KvEventsError::Truncated));
    // A payload over the limit is refused from its length.
    let small = DecodeLimits {
        max_payload: 8,
        ..limits()
    };
    assert_eq!(
        decode_batch(&fixture("mixed"), &small),
        Err(KvEventsError::PayloadTooLarge { len: 216, max: 8 })
    );
    // A 65-byte hash.
    let mut s = mixed();
    if let KvEvent::BlockStored(st) = &mut s.events[0] {
        st.block_hashes[0] = BlockHash::Bytes(vec![1; 65]);
    }
    assert!(matches!(
        decode_batch(&encode_batch(&s), &limits()),
        Err(KvEventsError::TooMany {
            what: "bytes in a block hash",
            ..
        })
    ));
}

#[test]
fn deep_nesting_in_a_skipped_field_is_refused() {
    // {"type": "AllBlocksCleared", "x": [[[[...]]]]} nested 10_000 deep.
    let mut b = vec![0x92, 0x00, 0x91, 0x82, 0xa4];
    b.extend_from_slice(b"type");
    b.push(0xb0);
    b.extend_from_slice(b"AllBlocksCleared");
    b.extend_from_slice(&[0xa1, b'x']);
    b.extend(std::iter::repeat_n(0x91, 10_000));
    b.push(0xc0);
    assert_eq!(decode_batch(&b, &limits()), Err(KvEventsError::TooDeep));
}

#[test]
fn malformed_events_get_typed_errors() {
    let stored = |blocks: usize, tokens: u32| KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: (0..blocks as i128).map(BlockHash::Int).collect(),
            parent_block_hash: None,
            token_ids: (0..tokens).collect(),
            block_size: 4,
            lora_id: None,
            medium: None,
            lora_name: None,
            group_idx: None,
        })],
        data_parallel_rank: None,
    };
    assert_eq!(
        decode_batch(&encode_batch(&stored(2, 7)), &limits()),
        Err(KvEventsError::TokenCount {
            blocks: 2,
            block_size: 4,
            tokens: 7
        })
    );
    assert!(decode_batch(&encode_batch(&stored(2, 8)), &limits()).is_ok());
    // {"type": "Nope"}
    let mut b = vec![0x92, 0x00, 0x91, 0x81, 0xa4];
    b.extend_from_slice(b"type");
    b.push(0xa4);
    b.extend_from_slice(b"Nope");
    assert_eq!(
        decode_batch(&b, &limits()),
        Err(KvEventsError::UnknownEvent("Nope".into()))
    );
    // {"type": "BlockRemoved"} without its hashes.
    let mut b = vec![0x92, 0x00, 0x91, 0x81, 0xa4];
    b.extend_from_slice(b"type");
    b.push(0xac);
    b.extend_from_slice(b"BlockRemoved");
    assert_eq!(
        decode_batch(&b, &limits()),
        Err(KvEventsError::MissingField("block_hashes"))
    );
}

#[test]
fn the_envelope_is_topic_sequence_payload() {
    let m = message(b"kv", 7, vec![1, 2]);
    assert_eq!(
        split_message(&m).unwrap(),
        (&b"kv"[..], 7u64, &[1u8, 2][..])
    );
    assert_eq!(m[1], 7u64.to_be_bytes());
    assert_eq!(
        split_message(&[vec![], vec![0; 7], vec![]]),
        Err(KvEventsError::Envelope)
    );
    assert_eq!(
        split_message(&[vec![], vec![0; 8]]),
        Err(KvEventsError::Envelope)
    );
}
