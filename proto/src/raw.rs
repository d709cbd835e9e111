//! A message whose encoding is held as bytes: what the server side sends for
//! `Machine` and `MachineList`, so a read copies bytes instead of building
//! and walking a message tree.

use prost::bytes::{Buf, BufMut, Bytes};
use prost::encoding::{decode_varint, encode_key, encode_varint, DecodeContext, WireType};
use prost::DecodeError;

/// The encoding of one message body (no length prefix), kept verbatim.
/// Decoding one keeps the received fields as they came, so a value read
/// from the wire re-encodes to the same bytes.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RawMessage(pub Bytes);

/// A `bigfleet.v1alpha1.Machine`, pre-encoded.
pub type EncodedMachine = RawMessage;
/// A `bigfleet.v1alpha1.MachineList`, pre-encoded.
pub type EncodedMachineList = RawMessage;

impl RawMessage {
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for RawMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawMessage(<{} bytes>)", self.0.len())
    }
}

/// prost 0.14 offers no other way to build a decode error of our own.
#[allow(deprecated)]
fn decode_error(message: &'static str) -> DecodeError {
    DecodeError::new(message)
}

impl prost::Message for RawMessage {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        _ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        let mut field = Vec::with_capacity(16);
        encode_key(tag, wire_type, &mut field);
        let len = match wire_type {
            WireType::Varint => {
                encode_varint(decode_varint(buf)?, &mut field);
                0
            }
            WireType::ThirtyTwoBit => 4,
            WireType::SixtyFourBit => 8,
            WireType::LengthDelimited => {
                let len = decode_varint(buf)?;
                encode_varint(len, &mut field);
                len
            }
            WireType::StartGroup | WireType::EndGroup => {
                return Err(decode_error("groups are not part of this protocol"));
            }
        };
        let len = usize::try_from(len)
            .ok()
            .filter(|&len| len <= buf.remaining())
            .ok_or_else(|| decode_error("field length exceeds the message"))?;
        field.extend_from_slice(&buf.copy_to_bytes(len));
        let mut whole = Vec::with_capacity(self.0.len() + field.len());
        whole.extend_from_slice(&self.0);
        whole.extend_from_slice(&field);
        self.0 = Bytes::from(whole);
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0 = Bytes::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1alpha1 as pb;
    use prost::Message;

    fn sample() -> pb::Machine {
        pb::Machine {
            id: "proxmox/OnDemand/pve.small/pve1/000".into(),
            state: pb::MachineState::Idle as i32,
            host: Some(pb::HostRef {
                provider: "proxmox".into(),
                r#ref: "pve1/101".into(),
            }),
            price_per_hour: 0.25,
            labels: [("tier".to_string(), "gold".to_string())].into(),
            ..Default::default()
        }
    }

    #[test]
    fn decodes_and_reencodes_verbatim() {
        let bytes = sample().encode_to_vec();
        let raw = RawMessage::decode(bytes.as_slice()).unwrap();
        assert_eq!(raw.as_bytes(), bytes.as_slice());
        assert_eq!(raw.encode_to_vec(), bytes);
        assert_eq!(pb::Machine::decode(raw.as_bytes()).unwrap(), sample());
    }

    #[test]
    fn nested_in_a_message_matches_the_plain_encoding() {
        let machine = sample();
        let plain = pb::TransitionAck {
            operation_id: "op-1-1".into(),
            machine: Some(machine.clone()),
        };
        let served = crate::serving::TransitionAck {
            operation_id: "op-1-1".into(),
            machine: Some(RawMessage(machine.encode_to_vec().into())),
        };
        assert_eq!(served.encode_to_vec(), plain.encode_to_vec());
    }

    #[test]
    fn truncated_input_is_an_error() {
        let bytes = sample().encode_to_vec();
        assert!(RawMessage::decode(&bytes[..bytes.len() - 3]).is_err());
    }
}
