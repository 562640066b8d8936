package handlers_test

import "testing"

// fuzzSeed builds an input from control bytes (by offset) and data.
func fuzzSeed(ctl map[int]byte, data string) []byte {
	in := make([]byte, fuzzCtlLen, fuzzCtlLen+len(data))
	for off, v := range ctl {
		in[off] = v
	}
	return append(in, data...)
}

// Indexes in fuzzModes.
const (
	modeNone = iota
	modeStreamed
	modeBuffered
	modePartial
	modeDuplex
	modeGRPC
	modeFuture
)

// fuzzSeeds are the sequences Envoy really sends, per mode and connector, and
// the known traps; the fuzzer mutates from here.
func fuzzSeeds() [][]byte {
	const prompt = "\x05hello" // a 5-byte prompt read from the data
	var seeds [][]byte
	for conn := range byte(3) {
		for _, mode := range []byte{modeDuplex, modeBuffered} {
			// chat, streamed, 3 chunks, content-length, x-request-id, response path echoed.
			seeds = append(seeds, fuzzSeed(map[int]byte{ctlConnector: conn, ctlReqMode: mode, ctlRespMode: modeDuplex,
				ctlChunks: 2, ctlExtra: 1 | 32 | 128, ctlRespChunks: 3 | 2<<2}, "\x04req1"+prompt))
		}
	}
	for _, s := range []map[int]byte{
		{ctlReqMode: modeDuplex, ctlBody: 2, ctlExtra: 8 | 32, ctlRespChunks: 2},                          // hostile body and destination header
		{ctlReqMode: modeBuffered, ctlBody: 2, ctlConnector: 2, ctlLength: 1},                             // hostile, chunked BUFFERED, sglang
		{ctlReqMode: modeDuplex, ctlBody: 7, ctlChunks: 5},                                                // 70 KB body: several reply chunks
		{ctlReqMode: modeBuffered, ctlBody: 7, ctlLength: 0},                                              // 70 KB BUFFERED with content-length
		{ctlReqMode: modeDuplex, ctlExtra: 16 | 32 | 64, ctlRespChunks: 2},                                // trailers both ways
		{ctlReqMode: modeBuffered, ctlExtra: 16, ctlRespMode: modeNone},                                   // BUFFERED with trailers
		{ctlReqMode: modeDuplex, ctlPerturb: 1, ctlOps: 0},                                                // envoy#46237: final chunk twice
		{ctlReqMode: modeDuplex, ctlExtra: 32, ctlRespChunks: 1, ctlPerturb: 1, ctlOps: 4, ctlOps + 1: 9}, // response body after its end
		{ctlReqMode: modeBuffered, ctlPrefill: prefillSlow, ctlOptions: 1 << 5},                           // override_message_timeout
		{ctlReqMode: modePartial, ctlPrefill: prefillSlow, ctlOptions: 1 << 5},                            // BUFFERED_PARTIAL whole body
		{ctlReqMode: modePartial, ctlChunks: 128},                                                         // BUFFERED_PARTIAL cut at the limit
		{ctlReqMode: modeStreamed},                                                                        // unsupported mode: 500
		{ctlReqMode: modeGRPC},                                                                            // not implemented in Envoy
		{ctlReqMode: modeFuture, ctlRespMode: modeFuture, ctlExtra: 32, ctlRespChunks: 1},                 // unknown modes
		{ctlReqMode: modeNone, ctlExtra: 32, ctlRespMode: modeBuffered, ctlRespChunks: 1},                 // NONE routes from headers
		{ctlReqMode: modeDuplex, ctlPath: 8},                                                              // GET without a body
		{ctlReqMode: modeDuplex, ctlPath: 2},                                                              // an admin path: 404
		{ctlReqMode: modeDuplex, ctlPath: 5},                                                              // pass-through
		{ctlReqMode: modeDuplex, ctlBody: 3},                                                              // raw data body: 400
		{ctlReqMode: modeDuplex, ctlBody: 6},                                                              // no model: the engine serves its own
		{ctlReqMode: modeDuplex, ctlBody: 5},                                                              // n=2: decode-only
		{ctlReqMode: modeDuplex, ctlBody: 4, ctlLength: 1},                                                // empty chunked body
		{ctlReqMode: modeDuplex, ctlOptions: 2, ctlBody: 7},                                               // over a 300-byte limit: 413 at the headers
		{ctlReqMode: modeDuplex, ctlOptions: 2, ctlBody: 7, ctlLength: 1, ctlChunks: 7},                   // chunked, growing over the limit
		{ctlReqMode: modeBuffered, ctlLength: 2},                                                          // content-length off by one
		{ctlReqMode: modeBuffered, ctlLength: 4},                                                          // two content-length headers
		{ctlReqMode: modeDuplex, ctlPrefill: prefill5xx, ctlOptions: 4},                                   // retry on the second endpoint
		{ctlReqMode: modeDuplex, ctlPrefill: prefill5xx, ctlOptions: 1},                                   // on_failure fail: 502
		{ctlReqMode: modeBuffered, ctlPrefill: prefill4xx},                                                // engine 4xx passed on
		{ctlReqMode: modeBuffered, ctlPrefill: prefill4xxNoType},                                          // engine 4xx without a content-type
		{ctlReqMode: modeDuplex, ctlPrefill: prefillHang},                                                 // prefill timeout
		{ctlReqMode: modeDuplex, ctlPrefill: prefillHang, ctlConnector: 2, ctlStyle: 2 | 2<<2},            // sglang leg outlives a reset stream
		{ctlReqMode: modeDuplex, ctlPrefill: prefillDrop},                                                 // connection dropped
		{ctlReqMode: modeDuplex, ctlPrefill: prefillRefused, ctlOptions: 1},                               // refused, on_failure fail: 503
		{ctlReqMode: modeDuplex, ctlPrefill: prefillNullParams},                                           // no params: decode recomputes
		{ctlReqMode: modeDuplex, ctlPrefill: prefillArrayParams},
		{ctlReqMode: modeDuplex, ctlPrefill: prefillGarbage},
		{ctlReqMode: modeDuplex, ctlPrefill: prefillNoParams, ctlOptions: 8 | 16},                   // verbose logs and metrics
		{ctlReqMode: modeDuplex, ctlStyle: 2 | 1<<2, ctlPrefill: prefillHang},                       // reset after the headers
		{ctlReqMode: modeBuffered, ctlStyle: 2 | 2<<2, ctlPrefill: prefillHang, ctlOptions: 1 << 5}, // reset during the prefill leg
		{ctlStyle: 1, ctlPerturb: 8, ctlOps: 1, ctlOps + 1: 1, ctlOps + 2: 1, ctlOps + 3: 0, ctlOps + 4: 2, ctlOps + 6: 3, ctlOps + 8: 4, ctlOps + 9: 1, ctlOps + 10: 5, ctlOps + 12: 6, ctlOps + 14: 1, ctlOps + 15: 3}, // chaos
	} {
		seeds = append(seeds, fuzzSeed(s, "\x04req2"+prompt))
	}
	return seeds
}

// TestEngineErrorWithoutContentTypeSetsNoEmptyHeader: a prefill engine's 4xx
// without a Content-Type reaches the client with Envoy's own local-reply
// content type, not an empty content-type header (found by FuzzProcess).
func TestEngineErrorWithoutContentTypeSetsNoEmptyHeader(t *testing.T) {
	c := decodeFuzzCase(fuzzSeed(map[int]byte{ctlReqMode: modeBuffered, ctlPrefill: prefill4xxNoType}, "\x05hello"))
	runFuzzCase(t, c)
}
