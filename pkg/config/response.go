package config

import "fmt"

// Response configures what the service does with the decode engine's answer
// on its way back. Its keys take effect on restart.
type Response struct {
	// RewriteUsage replaces the decode engine's count of cached prompt tokens
	// in the answer to a P/D request (kv-nixl, kv-shared-storage) with the
	// prefill engine's: the decode engine counts the KV it pulled as cached.
	// Each API's field: usage.prompt_tokens_details.cached_tokens, the
	// Responses API's input_tokens_details, the Messages API's
	// cache_read_input_tokens. It needs Envoy to send response bodies in
	// FULL_DUPLEX_STREAMED.
	RewriteUsage bool `json:"rewrite_usage"`
	// MaxBodyBytes bounds a non-streamed answer (or one event of a stream)
	// held for the rewrite; a larger one is passed on unchanged.
	MaxBodyBytes int64 `json:"max_body_bytes"`
}

// DefaultMaxResponseBytes is response.max_body_bytes when the file leaves it
// out: far above a chat answer, with logprobs, of a few thousand tokens.
const DefaultMaxResponseBytes = 4 << 20

// SetDefaults fills the keys left out.
func (r *Response) SetDefaults() {
	orDefault(&r.MaxBodyBytes, DefaultMaxResponseBytes)
}

// Validate checks the keys under key ("response").
func (r Response) Validate(key string) error {
	if r.MaxBodyBytes < 1 || r.MaxBodyBytes > 1<<30 {
		return fmt.Errorf("%s.max_body_bytes: %d is not between 1 and %d", key, r.MaxBodyBytes, 1<<30)
	}
	return nil
}
